"""GuardedOptimizer: wraps any torch.optim.Optimizer so that guard.step(loss) replaces
optimizer.step(). The engine is stepguard's C++ step engine (stepguard._C), the same one the C++
GuardedOptimizer runs."""

import contextlib
import os
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from . import _C, _amp, _deferred, _log
from ._guard_setup import (check_default_group, check_zero_group, checked_scaler,
                           guard_options_of, init_hook_tables, with_module_probes)
from ._C import StepReport
from ._pictures import IncidentPictures
from ._port import TorchOptimPort, check_name, is_zero_redundancy

#: The key of the guard's own state in every saved state dict and framework checkpoint.
STATE_KEY = "stepguard"


class GuardedOptimizer(torch.optim.Optimizer):
    """A guarded optimizer, accepted wherever ``optimizer`` is.

    ``step(loss)`` inspects every gradient and the loss in one fused pass, agrees across ranks in
    one all-reduce, and applies the wrapped optimizer's step, skips it, rolls back, lowers the LR
    or aborts as the policy says; it returns a ``StepReport``. ``param_groups``, ``state``,
    ``defaults``, ``zero_grad`` and ``add_param_group`` pass through to the wrapped optimizer, so
    ``torch.optim.lr_scheduler`` schedulers take the guard (step the scheduler only when
    ``report.applied``).

    Args:
        optimizer: the ``torch.optim.Optimizer`` to guard.
        named_parameters: ``model.named_parameters()`` (or pairs), for blame in reports.
        policy: path of a YAML policy file; ``policy_yaml``: the policy as text.
        process_group: the group the ranks agree through (``dist.group.WORLD``, any
            ``new_group``); None for one process.
        port: an integration's port (see ``stepguard.integrations``); default a
            ``TorchOptimPort``.
        Other keywords mirror the C++ ``GuardOptions``: trace_path, trace_every_step,
        checkpoint_dir, checkpoint_every, incident_dir, metrics_port, metrics_bind_address,
        metrics_run_label, loss_scaling, sharded_gradients, collective_timeout (seconds),
        max_consecutive_bad_steps, zero_grad_on_skip, max_blamed_tensors, run_id (the run its
        checkpoints belong to), enabled.
        enabled: False turns the guard off, as ``GradScaler(enabled=False)`` does: the wrapped
            optimizer steps as without it (no inspection, collective or read per step; no
            snapshot, trace, incident or metrics endpoint; a GradScaler steps it as a plain
            optimizer); reports say ``applied`` with the grad norm and loss NaN (not measured);
            the step count goes on and ``state_dict()`` round-trips the guard's state. Every rank
            must agree (checked when the guard is built). The policy is still read and checked.
        grad_scaler: the ``torch.amp.GradScaler`` that steps the guard (PyTorch's fp16 recipe:
            ``scaler.scale(loss).backward(); scaler.step(guard, loss.detach());
            scaler.update()``). The scaler calls the guard on every step, the ones it would
            leave out included; the guard judges the gradients the scaler unscaled (its
            ``unscale_`` runs once, as GradScaler runs it), with the scaler's scale; an overflow
            is the ``overflow`` signal, skipped on every rank, and every rank's scaler backs off
            (a fault of one rank alone included); growth and backoff stay the scaler's. A guard
            stepped by a GradScaler it was not given refuses the step. allow_untested_framework:
            a torch whose GradScaler code differs from the tested releases' runs with a warning.
        layout: how the ranks hold each parameter's gradient, one ``stepguard.Placement`` per
            parameter of the optimizer's param groups in order (``replica()``, the default for
            all; ``replicated(n)``, ``shard(n)``, ``absent()``), so that every element of the job
            counts once in the norm, the non-finite count and blame. Ranks may hold different
            lists; lists that do not fit together are refused here, on every rank.
        deferred: True makes the step's verdict with no host read or wait, for an optimizer that
            skips on a device flag (torch's Adam, AdamW, SGD, Adagrad with ``fused=True``): a
            non-finite gradient or loss, or a bad optimizer state, skips the update on the device
            at its step; the rest of the policy (rollback, LR, abort, incidents, metrics, trace)
            is decided one step later, and ``step()`` returns the previous step's report (None at
            the first; ``flush()`` decides the last). A rollback then drops the batch of the step
            that decides it. Refused with a loss scaler, ``set_replay()``, or a port that does
            not declare the torch optimizers its update steps (``gated_optimizers``).
        With trace_path and incident_dir, and matplotlib installed, each
        incident report gets a picture of the steps around it (``<report stem>.png``, linked from
        the report; the first 20 incidents of a guard).

    Sharded optimizer state (ZeRO-1): a ``torch.distributed.optim.ZeroRedundancyOptimizer`` is
    recognised by its type, no option needed. Every rank holds every gradient (DDP averages
    them) and every parameter; each rank keeps the optimizer state of its shard. A step the guard
    does not apply never calls the ZeRO optimizer's ``step()`` on any rank (so no rank
    broadcasts); an LR factor reaches its local optimizer and is taken out after the step; a
    rollback restores all parameters and each rank's own shard of the optimizer state; snapshots
    and disk checkpoints hold each rank's shard (one file per rank) without the collective
    ``consolidate_state_dict``, and a checkpoint resumes only on as many ranks as wrote it.
    Give the guard ``process_group`` (the ZeRO optimizer's group or one that contains it): the
    ranks must take the same decision. ``overlap_with_ddp=True`` is refused. Sharded gradients
    (ZeRO-2/3, FSDP: each rank holds part of the gradients): ``sharded_gradients=True``.

    FSDP2 (``torch.distributed.fsdp.fully_shard``): the parameters, gradients and optimizer
    state are DTensors sharded over the mesh. The guard inspects, snapshots and restores each
    rank's local shard (``to_local()``, the same storage) and needs ``sharded_gradients=True``;
    DTensors placed other than ``Shard`` on every mesh dimension are refused (their elements
    would be counted on several ranks).

    torch.optim's contract: the step hooks registered on the guard
    (``register_step_pre_hook``/``post_hook``) run around every guarded step, applied or not;
    those on the wrapped optimizer around its update, on applied steps only. The parameters are
    tracked by identity: tensors swapped into a param group are seen at the next step (its RAM
    snapshots, of the old tensors, are dropped). An exception from the wrapped optimizer's step
    reaches the caller with its own type (``torch.OutOfMemoryError`` stays one), chained to the
    guard's error; the step is recorded as skipped and the guard goes on.

    State dict: ``{"optimizer": <the wrapped optimizer's state_dict()>, "stepguard":
    <guard_state_dict()>}``; the guard's part is plain ints and lists (``step``,
    ``data_position``, ``guard``: the decision state, ``totals``, ``skipped_ranges``). The
    framework integrations save the guard's part in the framework's own checkpoint.

    Not thread-safe: one training thread drives one guard.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None, *,
                 policy: Union[str, "os.PathLike[str]", None] = None,
                 policy_yaml: Optional[str] = None,
                 process_group: Optional[Any] = None, store: Optional[Any] = None,
                 port: Optional[TorchOptimPort] = None,
                 layout: Optional[Sequence["_C.Placement"]] = None,
                 grad_scaler: Optional["torch.amp.GradScaler"] = None,
                 allow_untested_framework: bool = False, deferred: bool = False,
                 **options: Any) -> None:
        # The wrapped optimizer holds the state (param_groups, state and defaults pass through to
        # it), so Optimizer.__init__, which would rebuild them, is not called; what else it sets
        # up is: the hook tables its public registrars (register_step_pre_hook, ...) fill.
        init_hook_tables(self)
        guard_options = guard_options_of(policy, policy_yaml, process_group, store, options)
        if is_zero_redundancy(optimizer):
            check_zero_group(optimizer, process_group)
        check_default_group(process_group)
        if layout is not None and port is not None:
            raise ValueError("stepguard: give the layout to the port (its layout()) or to the "
                             "guard, not both")
        self._grad_scaler = checked_scaler(grad_scaler, port, guard_options,
                                           allow_untested_framework)
        self.enabled = guard_options.enabled
        self._gated = (_deferred.check_deferred(optimizer, port, grad_scaler, guard_options)
                       if deferred else [])
        self._deferred = bool(deferred) and self.enabled
        if not self.enabled:
            # Off: a GradScaler steps the guard as a plain optimizer (it unscales, and calls
            # step() on finite steps only), as it steps the wrapped one without the guard.
            self._step_supports_amp_scaling = False
        self.optimizer = optimizer
        if port is None:
            port = (TorchOptimPort(optimizer, named_parameters, layout=layout)
                    if grad_scaler is None else
                    _amp.ScalerPort(optimizer, named_parameters, grad_scaler, layout=layout))
        self._port = port
        if getattr(self._port, "dtensors", False) and not guard_options.sharded_gradients:
            raise ValueError(
                "stepguard: the parameters are DTensors (FSDP2's fully_shard): each rank holds a "
                "shard of every gradient, so the grad norm sums over ranks; pass "
                "sharded_gradients=True")
        self._guard = _C.Guard(self._port, guard_options)
        self._rank = self._guard.stats().rank  # for the log; fixed for the guard's life
        self._pictures = IncidentPictures.for_options(options)
        self._recorded_loss: Optional[torch.Tensor] = None
        self._stepping = threading.Lock()  # held for the whole of step(): no re-entry

    # -- pass-through: accepted wherever the wrapped optimizer is ------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Dict[Any, Any]:
        return self.optimizer.state

    @state.setter
    def state(self, value: Dict[Any, Any]) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> Dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch 2.x: gradients become None (``set_to_none=False`` zeroes them in place)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """ZeroRedundancyOptimizer's collective: gathers the full optimizer state on rank ``to``
        for ``state_dict()`` there; nothing for an optimizer that is not sharded (Lightning and
        Fabric call it on any optimizer that has it before saving). The guard's own snapshots
        and checkpoints never need it."""
        if hasattr(self.optimizer, "consolidate_state_dict"):
            self.optimizer.consolidate_state_dict(to=to)

    def __reduce__(self):
        # A live engine (threads, a process group, files) is saved as its state dict, not pickled.
        raise TypeError("stepguard: a GuardedOptimizer cannot be pickled or torch.save()d whole; "
                        "save guard.state_dict() and load it with load_state_dict()")

    def __repr__(self) -> str:
        return "GuardedOptimizer(%r)" % (self.optimizer,)

    # -- the guarded step ---------------------------------------------------------------------
    # torch's own wrapper: the step pre-hooks (global and this guard's) before, the post-hooks
    # after every guarded step, applied or not, and a profiler range around it. Hooks registered
    # on the wrapped optimizer run around its update: on applied steps only.
    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure: Union[torch.Tensor, Callable[[], torch.Tensor], None] = None
             ) -> StepReport:
        """Replaces ``optimizer.step()`` and returns a ``StepReport``. Called as torch.optim
        optimizers are:

        - ``step(loss)``: this rank's loss, a floating-point tensor of one element on the
          gradients' device (not the scaled one);
        - ``step(closure)``: calls ``closure()`` with gradients enabled (forward and backward,
          returning the loss, as for LBFGS and Lightning) and guards the result;
        - ``step()``: guards on the gradients alone, or uses the loss given earlier with
          ``record_loss(loss)``. Without a loss the loss detectors see no value this step
          (``report.loss`` is None, ``report.loss_given`` False).
        """
        with self._one_call("step()"):
            if self._grad_scaler is not None and callable(closure):
                raise TypeError("stepguard: a closure with grad_scaler: the scaler unscales "
                                "before the guard's step, i.e. before the closure's backward "
                                "(torch's GradScaler supports no closure either); run backward, "
                                "then scaler.step(guard, loss)")
            self._port.failure = None
            self._unscale()
            if self._deferred:
                try:
                    return _deferred.deferred_step(self, self._loss_of(closure))
                finally:
                    self._recorded_loss = None
            try:
                report = self._guard.step(self._loss_of(closure))
            except _C.StepguardError as error:
                failure, self._port.failure = self._port.failure, None
                if failure is None:
                    raise
                # The wrapped optimizer's own exception (torch.OutOfMemoryError, ...), as the
                # caller would get it from optimizer.step(); the step was recorded as skipped.
                if hasattr(failure, "add_note"):
                    failure.add_note("stepguard: raised by the wrapped optimizer's step; the "
                                     "guard recorded step %d as skipped"
                                     % self._guard.stats().step_count)
                raise failure from error
            finally:
                self._recorded_loss = None
            if self._grad_scaler is not None:
                _amp.agree_overflow(self._grad_scaler, self, report.nonfinite_count)
        return self._after_step(report)

    def verdict(self, loss: Optional[torch.Tensor] = None) -> "_C.Verdict":
        """The first phase of a step, for a framework that runs its own update: inspects, agrees
        (the step's one collective) and decides, changing no parameter and no optimizer state.
        Then, only when ``verdict.applies``: the framework's update with every learning rate
        times ``verdict.lr_factor``, its clip given ``verdict.grad_norm`` as the total norm (and
        ``clip_gradients(verdict)`` for the policy's clip). Then ``settle(verdict, applied)``.
        Nothing of the guard's but ``stats()`` in between. ``loss`` as for ``step(loss)``
        (None: the one given to ``record_loss``, or none)."""
        with self._one_call("verdict()"):
            if self._deferred:
                _deferred.refuse_phases("verdict()")
            self._unscale()
            v = self._guard.verdict(self._loss_of(loss))
            self._recorded_loss = None
            if self._grad_scaler is not None:
                _amp.agree_overflow(self._grad_scaler, self, v.nonfinite_count)
        return v

    def settle(self, verdict: "_C.Verdict", applied: bool) -> StepReport:
        """The second phase: restores (rollback), drops the gradients (skip), snapshots,
        checkpoints and records; returns the step's ``StepReport``. ``applied``: whether the
        update ran (False after an exception in it: the step is then recorded as skipped)."""
        if not isinstance(applied, bool):
            raise TypeError("stepguard: settle(verdict, applied): applied must be a bool, got %s"
                            % type(applied).__name__)
        with self._one_call("settle()"):
            report = self._guard.settle(verdict, applied)
        return self._after_step(report)

    def flush(self) -> Optional[StepReport]:
        """With ``deferred=True``: decides the step still waiting for its decision now (one host
        read; rollbacks, incidents and records as at the next step) and returns its report; None
        when none waits. Call it after the last step; the state dict calls it first."""
        with self._one_call("flush()"):
            return _deferred.flush(self)

    def clip_gradients(self, verdict: "_C.Verdict") -> None:
        """The policy's clip of ``verdict`` (its ``clip`` action) on the guarded gradients: one
        factor for all, so that the global norm becomes ``verdict.clip_norm``; nothing when the
        policy did not clip. ``step()`` does this itself."""
        self._guard.clip_gradients(verdict)

    @contextlib.contextmanager
    def _one_call(self, what):
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError(
                "stepguard: %s was called while another call of this guard's step is running "
                "(from a replay closure, a hook or another thread); a guard is not re-entrant "
                "and not thread-safe: one training thread drives it" % what)
        try:
            yield
        finally:
            self._stepping.release()

    # torch.amp.GradScaler's seam for optimizers that take part in loss scaling: its step()
    # calls ours on every step (the ones with Inf/NaN gradients included) with the attributes
    # grad_scale and found_inf set; a guard given no grad_scaler refuses such a step.
    _step_supports_amp_scaling = True

    def _unscale(self):
        scaler = self._grad_scaler
        if scaler is None:
            if "found_inf" in vars(self):  # set by a GradScaler's step() around ours
                del self.found_inf, self.grad_scale  # as the scaler left the guard: unchanged
                raise ValueError(
                    "stepguard: a torch.amp.GradScaler steps this guard, which was not given "
                    "it: build the guard with GuardedOptimizer(..., grad_scaler=scaler), so that "
                    "it judges the unscaled gradients with the scaler's scale and every rank's "
                    "scaler backs off on an overflow of any rank")
            return
        if scaler.is_enabled():
            _amp.unscale_once(scaler, self)

    def _loss_of(self, closure):
        if closure is None:
            return self._recorded_loss
        if torch.is_tensor(closure):
            return closure
        if callable(closure):
            with torch.enable_grad():
                loss = closure()
            if not torch.is_tensor(loss):
                raise TypeError("stepguard: step(closure): the closure must return this "
                                "step's loss tensor (it runs forward and backward), got %s"
                                % type(loss).__name__)
            return loss
        raise TypeError("stepguard: step() takes the loss tensor, a closure or nothing, "
                        "got %s" % type(closure).__name__)

    def _after_step(self, report):
        if self._pictures is not None:
            self._pictures.after_step(report)  # the trace line of this step is written
        incident = report.incident
        if incident is not None or report.rolled_back:
            _log.after_step(report, incident, self._rank)
        return report

    def record_loss(self, loss: torch.Tensor) -> None:
        """Gives this step's loss before a framework calls ``step()`` without one (a loss given
        to ``step`` itself wins). It is used by the next ``step()`` only."""
        if not torch.is_tensor(loss):
            raise TypeError("stepguard: record_loss() takes the loss tensor, got %s"
                            % type(loss).__name__)
        if loss.numel() != 1 or not loss.is_floating_point():
            raise ValueError("stepguard: record_loss() takes a floating-point tensor of one "
                             "element, got %s of shape %s" % (loss.dtype, tuple(loss.shape)))
        self._recorded_loss = loss.detach()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (with loss scaling on), to call backward() on."""
        return self._guard.scale_loss(loss)

    def check_inputs(self, inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
                     mask: Optional[torch.Tensor] = None) -> "_C.InputVerdict":
        """Checks this step's batch (NaN/Inf inputs; empty rows with a mask): evidence for an
        incident, saved with its report. Device ops only: whether the batch is bad rides in the
        step's one collective. Returns a verdict that is true when the batch looks fine (asking
        reads the counts once; ``.problems`` lists them); ignoring it costs no read."""
        if torch.is_tensor(inputs):
            inputs = [inputs]
        return self._guard.check_inputs(list(inputs), mask)

    def set_replay(self, fn: Optional[Callable[[str], torch.Tensor]],
                   model: Optional[torch.nn.Module] = None) -> None:
        """``fn(mode)`` recomputes this step's loss from the same batch and runs backward
        (mode: "as_is", "fp32", "anomaly"); used to classify NaN/Inf incidents. None removes it.

        With ``model``, each replay runs with a probe on every submodule's output (forward hooks,
        attached for that replay only: nothing is hooked on normal steps), so the report names
        the first module whose output was non-finite in forward order and the first whose
        gradient was in backward order, as one would find them by hand with hooks."""
        if fn is not None and model is not None:
            fn = with_module_probes(fn, model, self._guard)
        self._guard.set_replay(fn)

    def probe(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Marks a module output for forensics: ``x = guard.probe("blocks.0", block(x))``."""
        check_name(name, "probe name")
        return self._guard.probe(name, tensor)

    def track_buffers(self, named_buffers: Iterable[Tuple[str, Optional[torch.Tensor]]]) -> None:
        """Module buffers (``model.named_buffers()``) that snapshots and checkpoints hold."""
        self._guard.track_buffers([b for _, b in named_buffers if b is not None])

    def resume(self, directory: Union[str, "os.PathLike[str]"]) -> int:
        """Restores the newest checkpoint every rank holds intact; returns its step or 0."""
        step = self._guard.resume(str(directory))
        _log.after_resume(step, str(directory), self._rank)
        return step

    def commit_pending_checkpoint(self) -> None:
        """Makes the checkpoint written after the last step visible (end of a good run)."""
        self._guard.commit_pending_checkpoint()

    def wait_for_background_work(self) -> None:
        """Waits for the background work of the last step: the RAM snapshot copy and this rank's
        disk checkpoint write (a failure of either is logged and counted now). step() waits for
        the copy before it changes anything; call this before changing parameters or optimizer
        state in place between steps (model.load_state_dict, weight surgery)."""
        self._guard.wait_for_background_work()

    def set_data_position(self, position: int) -> None:
        """Sets the data position ``stats().data_position`` reports and checkpoints save."""
        self._guard.set_data_position(position)

    # -- state dict: the wrapped optimizer's and the guard's -----------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """``{"optimizer": <the wrapped optimizer's state_dict()>, "stepguard":
        <guard_state_dict()>}``; the state-dict hooks registered on the guard run around it
        (``register_state_dict_pre_hook``/``post_hook``, as torch.optim's)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        out = self._state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads what ``state_dict()`` returned: both parts, or neither (a part that does not
        fit raises and changes nothing). The load hooks run around it."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_state_dict(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), STATE_KEY: self.guard_state_dict()}

    def _load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or not {STATE_KEY, "optimizer"} <= set(state_dict):
            raise ValueError("stepguard: not a GuardedOptimizer state dict (it needs the keys "
                             "'optimizer' and 'stepguard')")
        # The guard's part is checked whole before it changes anything; if the optimizer's part
        # then fails, the guard goes back to what it was: both load, or neither.
        before = self.guard_state_dict()
        self.load_guard_state_dict(state_dict[STATE_KEY])
        try:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        except BaseException:
            self.load_guard_state_dict(before)
            raise

    def guard_state_dict(self) -> Dict[str, Any]:
        """The guard's own state, what a framework checkpoint carries beside the optimizer's:
        ``step`` (steps taken), ``data_position`` (batches consumed, skips included),
        ``guard`` (the decision state's words: detector statistics, LR factor and its
        recovery, loss scale, budgets; versioned by the guard itself), ``totals`` (the running
        counts by name: steps, applied, skipped, rolled_back, aborted, incidents, snapshots,
        checkpoints_written) and ``skipped_ranges`` (batches a rollback dropped, as (first,
        count) pairs). Plain ints, lists and dicts: ``torch.save`` and
        ``torch.load(weights_only=True)`` take it. Loading takes the totals by name (a count
        the state lacks starts at 0; an unknown name is refused) or as the 8 positional words
        state dicts held before."""
        self.flush()  # deferred=True: the step waiting for its decision is decided first
        return self._guard.record()

    def load_guard_state_dict(self, state: Dict[str, Any]) -> None:
        """Loads what ``guard_state_dict()`` returned; checked whole first (a key missing or out
        of range raises naming it, and nothing changes)."""
        self._guard.load_record(state)

    # -- what the guard knows -----------------------------------------------------------------
    def stats(self) -> "_C.GuardStats":
        """What the guard knows now, as one value with the C++ ``GuardStats`` field names:
        ``step_count``, ``totals``, ``aborted``, ``loss_scale``, ``lr_factor``, ``rank``,
        ``world_size``, ``data_position``, ``skipped_ranges``, snapshot and checkpoint counts,
        ``collective_calls``/``collective_bytes``/``step_buffer_bytes``, ``last_step_seconds``,
        ``metrics_endpoint``; ``to_dict()`` for JSON. Waits for the last step's snapshot copy."""
        return self._guard.stats()

    def metrics_text(self) -> str:
        return self._guard.metrics_text()

    def explain_policy(self) -> str:
        """The active policy in words (``stepguard policy explain``'s), as ``/policy`` serves."""
        return self._guard.explain_policy()


"""stepguard inside torchtitan: ``GuardedTrainer``, a ``torchtitan.trainer.Trainer`` whose every
step is guarded, built from its ``Config`` as torchtitan builds any trainer::

    from stepguard.integrations.torchtitan import GuardedTrainer, StepguardConfig, guarded

    config = guarded(llama3_debugmodel(), StepguardConfig(policy="default"))
    trainer = config.build()      # a GuardedTrainer
    trainer.train()

``guarded(config, options)`` turns any ``Trainer.Config`` into a ``GuardedTrainer.Config``
(``GuardedTrainer.Config(..., stepguard=StepguardConfig(...))`` directly works too; on the
command line the options are ``--stepguard.policy`` and so on). torchtitan has no callbacks:
extension is by subclassing the Trainer, and this is that subclass. Per step, inside torchtitan's
own ``train_step``:

- the loss: ``forward_backward_step``'s return, summed over the step's micro-batches and scaled
  to this rank's mean loss per token (torchtitan divides by the global token count), on the
  device (no host read); under pipeline parallelism the last stage's;
- the verdict where torchtitan clips (after every backward, the last point before the update):
  one collective over every rank; the clip to ``training.max_norm`` (and the policy's) from the
  agreed norm, whose value torchtitan logs (NaN on a step with a non-finite gradient, as
  torchtitan alone logs). ``StepguardConfig(framework_norm=True)``: torchtitan computes and clips
  with its own norm, so a clean step is bitwise an unguarded twin's (one more norm and
  all-reduce per step, as without the guard);
- ``optimizers.step()`` and ``lr_schedulers.step()`` run only when the step is applied (with the
  policy's LR factor); a step the guard does not apply leaves parameters, optimizer state and
  schedule untouched; torchtitan's "Loss is not finite" stop is not raised for such a step (the
  guard's incident line is logged instead); then the guard settles (rollback, snapshot);
- after a rollback the guard skips the batches the policy drops: the next step draws them from
  torchtitan's data iterator and discards them.

The guard's state is in torchtitan's checkpoints: the trainer's own ``Stateful`` state gains the
key ``stepguard_rank<r>`` (each rank's), saved by DCP with the model and optimizer and loaded on
resume. ``StepguardConfig(deferred=True)``: no host read or wait in the step (torchtitan's default
fused optimizers skip an update on the device flag the guard hands them; README "No host read
per step"): a NaN/Inf gradient or loss is skipped at its step, the clip is torch's
``clip_grads_with_norm_`` from the agreed norm on the device, and the rest of the policy is decided
inside the next step (a rollback there drops that step's batch), with ``lr_schedulers.step()``
held until the update it follows is known to stand. Layouts guarded: FSDP2 (``data_parallel_shard_degree``) and pipeline parallelism, each
alone or together (every rank holds a shard or a stage: the guard sums over every rank); a
layout where ranks hold copies of a parameter (``data_parallel_replicate_degree``, tensor,
context or expert parallelism) and optimizer offload are refused when the trainer is built,
naming the setting. The torchtitan functions relied on are declared seams
(``_seams_torchtitan.py``), checked when the trainer is built.
"""

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as _dist_utils
from torchtitan.trainer import Trainer

from .. import _deferred
from .._guard import GuardedOptimizer
from .._port import TorchOptimPort
from ._chain import ChainedTorchOptimizer
from ._core import (DRAWN, FrameworkGuard, HostValue, check_version, clip_with_verdict,
                    guard_options, policy_clip_after, state_key)
from ._seams import check_seams

__all__ = ["GuardedTrainer", "StepguardConfig", "guarded"]

_NONFINITE_STOP = "Loss is not finite"  # torchtitan's train_step, after the update
_DROPPED = object()  # deferred: this step's batch is dropped (a rollback or abort decided in it)


@dataclass(kw_only=True, slots=True)
class StepguardConfig:
    """The guard's options in a torchtitan config (``--stepguard.<name>`` on its command line)."""

    policy: str = "default"
    """A preset name (``stepguard policy list``) or the path of a YAML policy file."""
    framework_norm: bool = False
    """torchtitan computes its own norm for its clip (bitwise an unguarded run; one more norm
    and all-reduce per step). Default: the guard's agreed norm, computed once."""
    allow_untested_framework: bool = False
    """Run on a torchtitan whose relied-on functions differ from the tested release's (warns)."""
    enabled: bool = True
    """False: the guard is off and every step is torchtitan's own (its own clip and norm)."""
    deferred: bool = False
    """No host read or wait in the step (torchtitan's fused optimizers skip on the device flag the
    guard hands them); the policy's other decisions come one step later (README)."""
    incident_dir: Optional[str] = None
    trace_path: Optional[str] = None
    metrics_port: Optional[int] = None
    collective_timeout: Optional[float] = None


def _refuse(config, options):
    """What the guard cannot guard, from the config, before anything is built."""
    implementation = config.optimizer.implementation
    if options.deferred and implementation != "fused":
        raise ValueError(
            "stepguard: deferred=True needs optimizers that skip an update on a device flag: "
            "optimizer.implementation='fused' (torchtitan's default); got %r%s" % (
                implementation, " (its bf16 moments have not been run with the deferred verdict: "
                "torch has no CPU kernel for them)" if implementation == "fused_opt_states_bf16"
                else ""))
    p = config.parallelism
    copies = [("data_parallel_replicate_degree", p.data_parallel_replicate_degree),
              ("tensor_parallel_degree", p.tensor_parallel_degree),
              ("context_parallel_degree", p.context_parallel_degree),
              ("expert_parallel_degree", p.expert_parallel_degree)]
    for name, degree in copies:
        if degree > 1:
            raise ValueError(
                "stepguard: parallelism.%s=%d is not guarded yet: ranks would hold copies of a "
                "parameter's gradient, which the guard would count more than once. Guarded: "
                "data_parallel_shard_degree (FSDP2) and pipeline_parallel_degree" % (name, degree))
    if config.training.enable_cpu_offload:
        raise ValueError("stepguard: training.enable_cpu_offload is not guarded (the optimizer "
                         "steps host copies); turn it off to guard the run")


class _ContainerPort(TorchOptimPort):
    """The guard's port over torchtitan's optimizers: the view of every torch optimizer of the
    ``OptimizersContainer`` (snapshots, rollback, the LR factor), whose update is the
    container's own ``step()``."""

    def __init__(self, container, named_parameters):
        super().__init__(ChainedTorchOptimizer(container.optimizers), named_parameters)
        self.container = container

    @property
    def gated_optimizers(self):
        """The torch optimizers ``update()`` steps: each takes the deferred verdict's flag."""
        return self.container.optimizers

    def update(self):
        self.container.step()


class _GuardedOptimizers:
    """``trainer.optimizers`` while guarded: ``step()`` is the update the verdict allows; the
    rest is torchtitan's container (the checkpointer keeps the container itself)."""

    def __init__(self, trainer, container):
        self._trainer, self._container = trainer, container

    def __getattr__(self, name):
        return getattr(self._container, name)

    def zero_grad(self, set_to_none=True):
        self._container.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        self._trainer._apply_update()


class _HeldSchedulers:
    """``trainer.lr_schedulers`` while guarded: ``step()`` only after an applied update."""

    def __init__(self, trainer, schedulers):
        self._trainer, self._schedulers = trainer, schedulers

    def __getattr__(self, name):
        return getattr(self._schedulers, name)

    def step(self):
        if self._trainer._step_applied:
            self._schedulers.step()
        elif self._trainer._update_issued:  # deferred: taken when the update is known to stand
            self._trainer._schedule_held = True


class GuardedTrainer(Trainer):
    """torchtitan's ``Trainer`` with every step guarded (the module's docstring says how)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        stepguard: StepguardConfig = field(default_factory=StepguardConfig)

    def __init__(self, config):
        options = config.stepguard
        check_version("torchtitan")
        check_seams("torchtitan", options.allow_untested_framework)
        _refuse(config, options)
        super().__init__(config)
        self.framework_norm = bool(options.framework_norm) or not options.enabled
        self._containers = (self.optimizers, self.lr_schedulers)
        named = [pair for part in self.model_parts for pair in part.named_parameters()]
        port = _ContainerPort(self.optimizers, named)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        kwargs = {k: getattr(options, k) for k in ("incident_dir", "trace_path", "metrics_port",
                                                    "collective_timeout", "enabled")
                  if getattr(options, k) is not None}
        # Every rank holds a shard (FSDP2) or a stage's parameters (PP) of each gradient, never
        # a copy (refused above): the guard sums over every rank.
        self.guard = GuardedOptimizer(port.optimizer, port=port, sharded_gradients=world > 1,
                                      deferred=options.deferred,
                                      **guard_options(kwargs, options.policy))
        self._deferred = self.guard._deferred
        self._schedule_held = False  # deferred: the schedule step owed to an update not yet known
        self.optimizers = _GuardedOptimizers(self, self._containers[0])
        self.lr_schedulers = _HeldSchedulers(self, self._containers[1])
        self._per_step = self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches
        # The step's loss (this rank's mean per token), the newest report, the batches a
        # rollback drops (drawn from torchtitan's data iterator before the next step).
        self.core = FrameworkGuard("torchtitan", "tokens", DRAWN)
        self._verdict = None
        self._step_applied = self._update_issued = False
        self._shown_norm = None  # the norm torchtitan logs, handed back by its clip

    # -- the step -----------------------------------------------------------------------------
    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=global_valid_tokens)
        if self.guard is not None and (not self.parallel_dims.pp_enabled
                                       or self.pp_has_last_stage):
            mine = labels if isinstance(labels, list) else [labels]
            tokens = sum((l != IGNORE_INDEX).sum() for l in mine)
            # torchtitan's loss: the local sum over the global token count.
            self.core.loss.add(loss, tokens=tokens, total=global_valid_tokens)
        return loss

    @property
    def last_report(self):
        """The newest step's report (None before the first)."""
        core = getattr(self, "core", None)  # (none before the guard, or without one)
        return core.last_report if core is not None else None

    def _clip(self, real):
        """torchtitan's ``dist_utils.clip_grad_norm_`` during a guarded step: the verdict, then
        the clip from the agreed norm (or torchtitan's own, ``framework_norm``)."""
        def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                            foreach=None, pp_mesh=None, ep_enabled=False):
            parameters = list(parameters)
            if self._deferred:
                return self._deferred_clip(parameters, max_norm, lambda: real(
                    parameters, max_norm, norm_type, error_if_nonfinite, foreach,
                    pp_mesh=pp_mesh, ep_enabled=ep_enabled))
            verdict = self._verdict = self.guard.verdict(self.core.loss.take())
            if self.framework_norm:
                norm = real(parameters, max_norm, norm_type, error_if_nonfinite, foreach,
                            pp_mesh=pp_mesh, ep_enabled=ep_enabled)
                policy_clip_after(parameters, max_norm, verdict)
                return norm
            if verdict.applies:
                clip_with_verdict(parameters, max_norm, verdict)
            shown = verdict.grad_norm if verdict.nonfinite_count == 0 else float("nan")
            return self._shown(parameters, shown)
        return clip_grad_norm_

    def _shown(self, parameters, value):
        """The norm torchtitan logs, as a device tensor filled from the host."""
        if self._shown_norm is None:
            self._shown_norm = HostValue(next((p.device for p in parameters), torch.device("cpu")))
        return self._shown_norm.of(value)

    def _deferred_clip(self, parameters, max_norm, own):
        """The deferred verdict where torchtitan clips: the previous step decided (its copy
        landed while this step ran forward and backward), then this step inspected and summed
        with no read, and clipped by torch's ``clip_grads_with_norm_`` from the agreed norm on
        the device (``own``: torchtitan's clip, with ``framework_norm``). After a rollback or an
        abort this step's batch, whose backward ran on the abandoned weights, is dropped."""
        report = self._resolved(_deferred.resolve(self.guard, batch_in_hand=True))
        if report is not None and (report.rolled_back or report.aborted):
            self._verdict = _DROPPED
            return self._shown(parameters, float("nan"))
        self._verdict = self.guard._guard.begin_deferred(self.core.loss.take())
        if self.framework_norm:
            return own()
        norm = self.guard._guard.deferred_grad_norm()
        if max_norm is not None and max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)
        return norm

    def _resolved(self, report):
        """A deferred step's decision (None: none waited): the schedule step torchtitan asked
        for after that step's update is taken now if the update ran and stands; the report is
        the newest."""
        if report is None:
            return None
        held, self._schedule_held = self._schedule_held, False
        if held and report.applied:
            self._containers[1].step()
        return self.core.finished(report)

    def _apply_update(self):
        verdict = self._verdict
        if verdict is None:
            raise RuntimeError(
                "stepguard: torchtitan stepped the optimizers without the gradient clip the "
                "guard takes its verdict in: this torchtitan release steps otherwise than the "
                "integration was tested with")
        if self._deferred:
            if verdict is not _DROPPED:
                found_inf, lr_factor = verdict
                _deferred.gated_apply(self.guard, found_inf, lr_factor, failed=self._resolved)
                self._update_issued = True
            return
        if verdict.applies:
            self.guard._port.apply(verdict.lr_factor)
            self._step_applied = True

    @contextlib.contextmanager
    def _clip_seam(self):
        real = _dist_utils.clip_grad_norm_
        _dist_utils.clip_grad_norm_ = self._clip(real)
        try:
            yield
        finally:
            _dist_utils.clip_grad_norm_ = real

    def train_step(self, data_iterator):
        if self.guard is None:
            return super().train_step(data_iterator)
        self.core.batches.draw(data_iterator, self._per_step)  # the last rollback's drops
        self.core.loss.clear()
        self._verdict, self._step_applied, self._update_issued = None, False, False
        try:
            with self._clip_seam():
                super().train_step(data_iterator)
        except RuntimeError as error:
            if self._deferred:
                if not self._deferred_stop_passes(error):
                    raise
            elif (self._verdict is None or self._step_applied
                  or not str(error).startswith(_NONFINITE_STOP)):
                self._settle()
                raise
            # torchtitan's stop for a non-finite loss, after a step the guard did not apply.
        if self._deferred:
            self._verdict = None
            if self._flush_due():
                self._resolved(_deferred.flush(self.guard))
            return None
        self._settle()
        return None

    def _deferred_stop_passes(self, error):
        """Whether torchtitan's stop for a non-finite loss (raised on its logging steps, after
        the update, on the ranks holding the loss) is for a step whose update did not run: a
        dropped batch, or a step the device flag skipped (the flag read here: torchtitan has
        just read the loss; the step is decided at the next step on every rank, as any other)."""
        if self._verdict is None or not str(error).startswith(_NONFINITE_STOP):
            return False
        if self._verdict is _DROPPED:
            return True
        found_inf, _ = self._verdict
        return bool(found_inf.item() > 0)

    def _flush_due(self):
        """Deferred: whether the step just run is decided before train_step returns: the last
        step, and a step torchtitan's checkpointer saves (its interval, and step 1), so that a
        checkpoint holds no step waiting for its decision."""
        config = self.config
        if self.step >= config.training.steps:
            return True
        saves = config.checkpoint
        return saves.enable and (self.step == 1 or self.step % saves.interval == 0)

    def _settle(self):
        verdict, self._verdict = self._verdict, None
        self.core.loss.clear()
        if verdict is None:
            return
        # (the guard's logger says the incident)
        self.core.finished(self.guard.settle(verdict, self._step_applied))

    # -- checkpoints --------------------------------------------------------------------------
    def _state_key(self):
        return state_key(self.guard._rank)

    def state_dict(self):
        state = super().state_dict()
        if self.guard is not None:
            if self._deferred:
                self._resolved(_deferred.flush(self.guard))
            state[self._state_key()] = self.guard.guard_state_dict()
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if self.guard is not None and self._state_key() in state_dict:
            self.guard.load_guard_state_dict(state_dict[self._state_key()])

    def detach(self):
        """Stops guarding: the trainer's own optimizers and schedulers are back and later steps
        are torchtitan's own. Returns the guard (its reports and totals stay readable)."""
        if self.guard is not None and self._deferred:
            self._resolved(_deferred.flush(self.guard))
        guard, self.guard = self.guard, None
        if guard is not None:
            self.optimizers, self.lr_schedulers = self._containers
        return guard


def guarded(config, options=None):
    """``config`` (a torchtitan ``Trainer.Config``) as a ``GuardedTrainer.Config`` with the
    guard's ``options`` (a ``StepguardConfig``; default: the default policy)."""
    if not isinstance(config, Trainer.Config):
        raise TypeError("stepguard: guarded(config): expected a torchtitan Trainer.Config, got %s"
                        % type(config).__name__)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.init and f.name != "stepguard"}
    return GuardedTrainer.Config(**values, stepguard=options or StepguardConfig())

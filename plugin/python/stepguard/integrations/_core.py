"""What the framework integrations have in common, written once: the guard's options as a
framework hands them over (the process group, one trace per rank), the refusals that hold in every
framework whose backward the guard does not own, the framework's gradient clip driven by the
guard's agreed norm, and each step's figures for the framework's logger, read off the step
reports (no call that waits for the step's background snapshot copy)."""

import importlib.metadata
import logging
import warnings

import torch
from packaging.version import InvalidVersion, Version

from .._amp import (GRAD_SCALER_FLOOR, ScalerPort, scaled_loss_unscaled, scaler_unscaled,
                    unscale_once)
from .._guard import STATE_KEY, GuardedOptimizer
from .._log import logger
from .._port import is_dtensor
from ._clip import HostValue, clip_to, clip_with_verdict, policy_clip_after

__all__ = ["check_version", "TESTED", "guard_options", "per_rank_path", "refuse_bypass",
           "clip_with_verdict", "policy_clip_after", "clip_to", "HostValue", "finish_step", "load_guard_state",
           "SeamGuard", "Figures", "is_off", "OUTCOME_CODES", "TrainerPort", "unscale_once",
           "scaler_unscaled", "GRAD_SCALER_FLOOR", "STATE_KEY", "StepLoss", "DroppedBatches",
           "FrameworkGuard"]

#: A report's outcome as a number for loggers that take numbers only ("dropped": a batch after a
#: rollback that was run but not stepped, as the policy's ``skip_batches`` says).
OUTCOME_CODES = {"applied": 0, "skipped": 1, "rolled_back": 2, "aborted": 3, "dropped": 4}

# The options naming a file or directory each rank writes: one per rank in a multi-rank job.
_PER_RANK_PATHS = ("trace_path",)


#: The releases of each framework the integration tests ran (README "Supported versions"), oldest
#: and newest: the seams each integration uses are in both.
TESTED = {"deepspeed": ("0.19.8", "0.19.8"), "megatron-core": ("0.16.1", "0.19.2"),
          "lightning": ("2.6.6", "2.6.6"), "transformers": ("5.24.0", "5.24.0"),
          "accelerate": ("1.15.0", "1.15.0"), "torchtitan": ("0.3.0", "0.3.0")}


def installed_version(package):
    """The installed release of ``package`` (its distribution's metadata)."""
    return importlib.metadata.version(package)


def check_version(package, version=None):
    """Refuses a ``package`` release older than the tested range and warns about a newer one, by
    release number ("0.19.2rc1" and "0.19.2+78b9952" are 0.19.2); ``version``: the installed one
    when left out."""
    oldest, newest = TESTED[package]
    if version is None:
        version = installed_version(package)
    tested = oldest if oldest == newest else "%s to %s" % (oldest, newest)
    try:
        found = Version(str(version)).release
    except InvalidVersion:
        raise RuntimeError("stepguard: cannot read the %s version %r (the releases tested are "
                           "%s)" % (package, version, tested)) from None
    if found < Version(oldest).release:
        raise RuntimeError("stepguard: %s %s is older than the releases tested (%s): the seams "
                           "the integration uses may be missing; install a tested release"
                           % (package, version, tested))
    if found > Version(newest).release:
        warnings.warn("stepguard: %s %s is newer than the releases tested (%s)"
                      % (package, version, tested), RuntimeWarning, stacklevel=3)


def _world():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def per_rank_path(path, rank):
    """``path`` for rank 0, ``path.rank<r>`` for the others (as ``stepguard demo`` names them)."""
    return path if rank == 0 else "%s.rank%d" % (path, rank)


def guard_options(options, policy=None):
    """The ``GuardedOptimizer`` keywords a framework integration passes: ``options`` as the user
    gave them, with ``process_group`` defaulting to WORLD when torch.distributed runs several
    ranks (every rank must take the same decision) and each rank's own trace file when one
    ``trace_path`` is given to several ranks (two guards cannot write one file)."""
    out = dict(options)
    rank, world = _world()
    if world > 1:
        out.setdefault("process_group", torch.distributed.group.WORLD)
        for key in _PER_RANK_PATHS:
            if out.get(key):
                out[key] = per_rank_path(str(out[key]), rank)
    if policy is not None:
        out["policy"] = policy
    return out


def is_off(options):
    """Whether the guard's ``options`` turn it off (``enabled=False``): the framework then clips
    with its own norm, as without the guard (the guard measures none)."""
    return options.get("enabled", True) is False


def with_sharding(options, optimizer):
    """``options`` with ``sharded_gradients=True`` when ``optimizer`` steps DTensors (FSDP2's
    ``fully_shard``, Lightning's ModelParallelStrategy): each rank then holds a shard of every
    gradient and the guard sums over ranks. Detected from the parameters, not asked of the user;
    a value the user gave stands."""
    if "sharded_gradients" in options:
        return options
    if any(is_dtensor(p) for group in optimizer.param_groups for p in group["params"]):
        return dict(options, sharded_gradients=True)
    return options


def refuse_bypass(guard, framework):
    """Makes a step of the wrapped optimizer that does not come through the guard an error: a
    framework that steps it another way (an optimizer-step wrapper captured at setup, a release
    that calls it directly) would apply steps the guard skipped. Returns the hook's handle."""
    port = guard._port

    def check(optimizer, args, kwargs):
        if not port.updating:
            raise RuntimeError(
                "stepguard: %s stepped the wrapped %s outside the guard: the guard's decision "
                "(skip, rollback) would be bypassed. This %s release steps the optimizer "
                "otherwise than the integration was tested with"
                % (framework, type(optimizer).__name__, framework))

    return guard.optimizer.register_step_pre_hook(check)


def finish_step(guard, verdict, max_norm=None, update=None, clip=True):
    """The second half of a step whose verdict a framework seam took: the update the verdict
    allows, then ``settle``. The update: ``update()`` when given (the framework's own, which
    clips from the agreed norm itself and returns whether it applied the step), else the
    framework's clip to ``max_norm`` and the policy's by one factor from the agreed norm (or the
    policy's alone; no clip with ``clip=False``: the framework clipped with its own norm, the
    policy's clip after it) and the wrapped optimizer's step with the LR factor. An exception in
    the update settles the step as not applied and goes on up with its own type."""
    applied = False
    if verdict.applies:
        try:
            if update is not None:
                applied = bool(update())
            else:
                if not clip:
                    pass
                elif max_norm:
                    params = [p for g in guard.param_groups for p in g["params"]]
                    clip_with_verdict(params, max_norm, verdict)
                else:
                    guard.clip_gradients(verdict)
                guard._port.apply(verdict.lr_factor)
                applied = True
        except BaseException:
            guard._port.failure = None  # raised here as it is: nothing to keep
            guard.settle(verdict, False)
            raise
    return guard.settle(verdict, applied)


class GradientWatch:
    """Hooks naming a fault's origin rank: each trainable gradient as backward makes it, before
    the framework reduces it (DDP, ZeRO, Megatron), so a NaN/Inf there names this rank, not every
    rank the reduction reached. One sum (fp32) per gradient per backward, no read; for an enabled
    guard over several ranks. FSDP2's DTensors (set after their reduce-scatter) get none."""

    def __init__(self):
        self._handles = []

    def install(self, guard, parameters):  # (earlier hooks of this watch removed)
        self.remove()
        if guard.enabled and _world()[1] > 1:  # (the engine's method: it returns None)
            self._handles = [p.register_hook(guard._guard.watch_gradient) for p in parameters
                             if p.requires_grad and not is_dtensor(p)]
        return self

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []


def load_guard_state(guard, record, where):
    """Loads the guard's state a framework checkpoint holds (``guard_state_dict()``'s); None,
    from a checkpoint saved without stepguard: a warning naming ``where`` that the guard starts
    afresh. Returns whether a state was loaded."""
    if record is None:
        step = guard.stats().step_count
        then = ("the guard starts fresh (step count, totals, detectors, LR factor and data "
                "position from 0)" if step == 0 else
                "the guard keeps the state it has (after its step %d)" % step)
        warnings.warn("stepguard: %s holds no guard state (saved without stepguard): %s"
                      % (where, then), RuntimeWarning, stacklevel=3)
        return False
    guard.load_guard_state_dict(record)
    return True


class StepLoss:
    """The one owner of a step's loss, the loss the guard judges and reports: the mean of the
    step's micro-batch losses, however the framework hands them over. ``reduction`` says how
    it does: ``"mean"``, each micro-batch's own loss (DeepSpeed's ``engine.backward(loss)``);
    ``"sum"``, each already divided by the step's micro-batch count before backward (Lightning,
    HF's Trainer, Megatron's ``grad_scale_func``: their sum is the mean); ``"tokens"``, each a
    sum over its tokens divided by the step's token count over every rank (torchtitan:
    ``add(loss, tokens=<this micro-batch's tokens>, total=<the step's global count>)``, the
    step's loss this rank's mean per token). Kept on the device; ``take()`` hands it over once
    and starts the next step."""

    REDUCTIONS = ("mean", "sum", "tokens")

    def __init__(self, reduction):
        if reduction not in self.REDUCTIONS:
            raise ValueError("stepguard: StepLoss reduction %r is not one of %s"
                             % (reduction, ", ".join(self.REDUCTIONS)))
        self.reduction = reduction
        self._parts = []

    def add(self, loss, tokens=None, total=None):
        self._parts.append((loss.detach().float().sum().reshape(()), tokens, total))

    def __bool__(self):
        return bool(self._parts)

    def clear(self):
        self._parts = []

    def take(self):
        """The step's loss (a 0-d fp32 tensor on the loss's device), or None when none came."""
        parts, self._parts = self._parts, []
        if not parts:
            return None
        total = torch.stack([loss for loss, _, _ in parts]).sum()
        if self.reduction == "sum":
            return total
        if self.reduction == "mean":
            return total / len(parts)
        tokens = torch.stack([torch.as_tensor(t) for _, t, _ in parts]).sum()
        every = torch.as_tensor(parts[0][2]).to(total.device, torch.float32)
        return total * every / tokens.to(total.device, torch.float32).clamp(min=1.0)


#: How an integration honours the batches a rollback drops (``DroppedBatches``).
DRAWN, RUN_NOT_STEPPED, LOOP, OUT_OF_REACH = "drawn", "run", "loop", "out of reach"


class DroppedBatches:
    """The one rule for the batches a rollback drops (the policy's ``skip_batches``, a report's
    ``batches_to_skip``): never trained on where the integration reaches the data order, said
    once per run where it cannot. ``how``: ``DRAWN``, the integration draws them from the
    framework's data iterator before the next step (``draw``: torchtitan); ``RUN_NOT_STEPPED``,
    the framework runs them and the guard steps none of them (``take``: Lightning); ``LOOP``, the
    user's loop owns the iterator (DeepSpeed, Megatron): ``draw(iterator)`` before its next step
    does it, and the first rollback says so; ``OUT_OF_REACH`` (HF's Trainer, Lightning over
    DeepSpeed): the first rollback warns that they are trained on. ``pending``: batches still to
    drop; ``dropped``: dropped so far."""

    def __init__(self, framework, how):
        self.framework, self.how = framework, how
        self.pending = 0
        self.dropped = 0
        self._told = False

    def note(self, report):
        """After each step's report: its ``batches_to_skip`` join the pending ones."""
        if report is None or not report.batches_to_skip:
            return
        if self.how != OUT_OF_REACH:
            self.pending += report.batches_to_skip
        if self._told or self.how in (DRAWN, RUN_NOT_STEPPED):
            return
        self._told = True
        lead = _world()[0] == 0  # every rank drops the same batches: rank 0 says it
        if self.how == LOOP:
            logger.log(logging.INFO if lead else logging.DEBUG,
                       "stepguard: the policy's rollback drops the next %d batch(es); under %s "
                       "the training loop owns the data iterator: draw them with "
                       "drop_batches(iterator) before the next step (or skip "
                       "report.batches_to_skip); said once per run",
                       report.batches_to_skip, self.framework)
        else:
            logger.log(logging.WARNING if lead else logging.DEBUG,
                       "stepguard: the policy's rollback asks to drop the next %d batch(es); "
                       "under %s the data order is out of the guard's reach, so they are trained "
                       "on (said once per run)", report.batches_to_skip, self.framework)

    def take(self):
        """Whether this batch is one to drop (``RUN_NOT_STEPPED``): counts it as dropped."""
        if self.pending <= 0:
            return False
        self.pending -= 1
        self.dropped += 1
        return True

    def draw(self, iterator, per_batch=1):
        """Draws the pending batches from ``iterator`` (``per_batch`` items each: micro-batches);
        returns how many batches were dropped."""
        count, self.pending = self.pending, 0
        for _ in range(count * per_batch):
            next(iterator)
        self.dropped += count
        return count


class FrameworkGuard:
    """What each framework integration keeps of its guarded steps, in one owner: the step's
    loss (``loss``, a ``StepLoss``), the newest report (``last_report``: None before the first
    step and for a batch a rollback dropped) and the batches a rollback drops (``batches``, a
    ``DroppedBatches``). The guard's saved state goes under ``STATE_KEY`` ("stepguard") in every
    framework's checkpoint (``state_key(rank)`` where each rank saves a file of its own); the
    incident line is the guard's logger's (rank 0, once per job)."""

    def __init__(self, framework, reduction, drops):
        self.loss = StepLoss(reduction)
        self.batches = DroppedBatches(framework, drops)
        self.last_report = None

    def finished(self, report):
        """A step's report (None: a dropped batch): the newest, its dropped batches noted."""
        self.last_report = report
        self.batches.note(report)
        return report


def state_key(rank=None):
    """The key (or file stem) of the guard's saved state: ``STATE_KEY``, with ``_rank<r>`` where
    each rank saves its own."""
    return STATE_KEY if rank is None else "%s_rank%d" % (STATE_KEY, rank)


class TrainerPort(ScalerPort):
    """A torch optimizer a Trainer steps (Lightning, HF): the Trainer decides the loss scale, so
    the guard scales nothing of its own; under fp16 (Lightning's '16-mixed', HF and accelerate's
    fp16) torch's ``scaler`` owns it (``stepguard._amp.ScalerPort``)."""


class SeamGuard(GuardedOptimizer):
    """The guard a framework steps, whose verdict a seam of that framework takes after backward
    and before the framework's clip (``take_verdict``, once per step). The framework's
    ``optimizer.step(closure)`` runs the closure when it has one (Lightning's runs backward and
    the seam), then the update the verdict allows (the framework's clip to ``max_norm`` from the
    agreed norm, the wrapped optimizer's step) and settles; with no verdict taken, the step is
    a plain guarded step. torch's step hooks fire around it once. The state dict is the wrapped
    optimizer's, so the framework's checkpoints keep their format and load with or without
    stepguard; the guard's own state travels beside it (``guard_state_dict``)."""

    # The framework's scaler steps the guard as it steps any optimizer (it leaves the step out
    # on Inf/NaN; step_the_scaler_skipped carries that step out) and unscales before the seam.
    _step_supports_amp_scaling = False
    framework = "the framework"  # for the messages of the subclass's framework
    drops = OUT_OF_REACH         # how its batches a rollback drops are honoured

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending = None   # the verdict the seam took this step
        self.max_norm = None  # the framework's clip of this step, done from the agreed norm
        self.clipped = False  # framework_norm: the framework clipped with its own norm already
        # This step's loss and the batches a rollback drops: the framework hands each
        # micro-batch's loss divided by their count (Lightning, HF's Trainer).
        self.core = FrameworkGuard(self.framework, "sum", self.drops)
        self.calls = 0        # step() calls: a framework's GradScaler may leave one out
        self.loss_expected = None  # what hands the loss, when one must reach every step
        self._unapplied = False
        self._clip = True

    def add_loss(self, loss):
        self.core.loss.add(loss)

    @property
    def loss_given(self):
        """Whether a loss of this step reached the guard."""
        return bool(self.core.loss)

    def take_verdict(self):
        if self.pending is None:
            self._check_loss_given()
            self.pending = self.verdict(self.core.loss.take())
        return self.pending

    def _check_loss_given(self):
        """A step whose loss never arrived, where a seam should have handed it, is an error (a
        framework that stopped calling that seam), not a verdict on the gradients alone."""
        if not self.core.loss and self.loss_expected is not None:
            raise RuntimeError(
                "stepguard: no loss reached the guard for step %d: %s, which this run did not "
                "call (a framework release that trains otherwise?); nothing was judged or "
                "applied" % (self.stats().step_count + 1, self.loss_expected))

    def drop_pending(self):
        """A verdict whose step never came (an exception between the seam and the step):
        settled as not applied, so that no later step runs on it."""
        verdict, self.pending, self.max_norm = self.pending, None, None
        self.clipped = False
        if verdict is not None:
            self.settle(verdict, False)

    def step_the_scaler_skipped(self):
        """The step a framework's GradScaler did not call (it found Inf or NaN in the gradients
        on this rank): the guard's decision is carried out all the same, never as an applied
        update: a skip, or the rollback or abort the policy chose (a NaN loss). The verdict is
        the one the seam took, or is taken now on the unscaled gradients. torch's step hooks
        fire around it as around any guarded step; returns the step's report."""
        self._unapplied = True
        try:
            return self.step()
        finally:
            self._unapplied = False

    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure=None):
        self.calls += 1
        loss = closure
        if callable(closure) and not torch.is_tensor(closure):
            try:
                with torch.enable_grad():
                    loss = closure()
            except BaseException:
                self.drop_pending()  # raised after the verdict: the step is not applied
                raise
            if not torch.is_tensor(loss):
                loss = None
        verdict, self.pending = self.pending, None
        max_norm, self.max_norm = self.max_norm, None
        self._clip, self.clipped = not self.clipped, False
        return self.core.finished(self._run(verdict, max_norm, loss))

    @property
    def last_report(self):
        """This guard's newest step report (``core.last_report``)."""
        return self.core.last_report

    @last_report.setter
    def last_report(self, report):
        self.core.last_report = report

    def _run(self, verdict, max_norm, loss):
        if self._unapplied:
            verdict = verdict if verdict is not None else self.take_verdict()
            self.pending = None
            return finish_step(self, verdict, update=lambda: False)
        if verdict is None:  # no seam call this step (a strategy or loop that steps otherwise)
            if loss is None:
                self._check_loss_given()
            given = self.core.loss.take()
            return GuardedOptimizer.step.__wrapped__(self, loss if loss is not None else given)
        return finish_step(self, verdict, max_norm, clip=self._clip)

    def _state_dict(self):
        return self.optimizer.state_dict()

    def _load_state_dict(self, state_dict):
        if STATE_KEY in state_dict and "optimizer" in state_dict:  # a guard's own layout
            super()._load_state_dict(state_dict)
        else:
            self.optimizer.load_state_dict(state_dict)


class Figures:
    """Each step's figures for a framework's logger, and the running counts, from the reports
    alone: ``update(report)`` once per step (None for a batch that was dropped). The counts start
    from ``guard``'s totals (a resumed guard's included); the loss scale and LR factor of a
    dropped batch are the last step's."""

    def __init__(self, guard):
        stats = guard.stats()
        totals = stats.totals.to_dict()
        self.counts = {k: totals.get(k, 0) for k in ("applied", "skipped", "rolled_back",
                                                     "incidents")}
        self.counts["dropped"] = 0
        self.scale = (stats.loss_scale, stats.lr_factor)
        self.last = None

    def update(self, report):
        self.last = report
        if report is not None:
            self.scale = (report.loss_scale, report.lr_factor)
        if report is None:
            self.counts["dropped"] += 1
            return
        if report.outcome in self.counts:
            self.counts[report.outcome] += 1
        if report.incident is not None:
            self.counts["incidents"] += 1

    def step_figures(self):
        """The last step's figures (NaN where a dropped batch has none) and the counts so far."""
        nan = float("nan")
        report = self.last
        out = {"outcome": OUTCOME_CODES["dropped"], "applied": 0, "grad_norm": nan,
               "nonfinite_count": nan, "loss_scale": self.scale[0], "lr_factor": self.scale[1]}
        if report is not None:
            out.update(outcome=OUTCOME_CODES.get(report.outcome, -1),
                       applied=int(report.applied), grad_norm=report.grad_norm,
                       nonfinite_count=report.nonfinite_count, loss_scale=report.loss_scale,
                       lr_factor=report.lr_factor)
        out.update((k, v) for k, v in self.counts.items() if k != "applied")
        return out

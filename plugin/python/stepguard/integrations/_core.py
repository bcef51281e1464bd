"""What the framework integrations have in common, written once: the guard's options as a
framework hands them over (the process group, one trace per rank), the refusals that hold in every
framework whose backward the guard does not own, the framework's gradient clip driven by the
guard's agreed norm, and each step's figures for the framework's logger, read off the step
reports (no call that waits for the step's background snapshot copy)."""

import importlib.metadata
import math
import warnings

import torch
from packaging.version import InvalidVersion, Version

from .._amp import (GRAD_SCALER_FLOOR, ScalerPort, scaled_loss_unscaled, scaler_unscaled,
                    unscale_once)
from .._guard import GuardedOptimizer
from .._port import is_dtensor

__all__ = ["check_version", "TESTED", "guard_options", "per_rank_path", "refuse_bypass",
           "clip_with_verdict", "policy_clip_after", "finish_step", "load_guard_state",
           "SeamGuard", "Figures", "OUTCOME_CODES", "TrainerPort", "unscale_once",
           "scaler_unscaled", "GRAD_SCALER_FLOOR"]

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


def clip_with_verdict(parameters, max_norm, verdict):
    """The framework's gradient clip to ``max_norm`` (and the policy's clip, when it clipped this
    step) by one factor, from the norm the guard agreed (``verdict.grad_norm``): the norm is not
    computed a second time. Nothing when neither clips or the norm is not finite."""
    targets = [t for t in (max_norm, verdict.clip_norm) if t is not None and t > 0.0]
    norm = verdict.grad_norm
    if not targets or not math.isfinite(norm):
        return
    params = [p for p in parameters if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, min(targets), torch.tensor(norm))


def policy_clip_after(parameters, max_norm, verdict):
    """With ``framework_norm``: the framework clipped to ``max_norm`` with its own norm; the
    policy's clip (``verdict.clip_norm``) on top, from the norm that clip left (the agreed norm
    brought to ``max_norm``). Nothing when the policy did not clip or the norm is not finite."""
    norm = verdict.grad_norm
    if not verdict.applies or verdict.clip_norm is None or not math.isfinite(norm):
        return
    if max_norm and max_norm > 0:
        norm = norm * min(1.0, max_norm / (norm + 1e-6))
    if norm > verdict.clip_norm:
        grads = [p for p in parameters if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(grads, verdict.clip_norm, torch.tensor(norm))


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


def watch_gradients(guard, parameters):
    """A hook on each trainable parameter's gradient as backward makes it, before the framework
    reduces it across ranks: a NaN/Inf there names this rank as the origin of the step's fault,
    where the guard alone would name the rank whose partition holds the reduced gradient. One
    fp64 sum per gradient per backward on the device, no read. Returns the handles."""
    engine = guard._guard

    def hook(grad):
        engine.watch_gradient(grad)

    return [p.register_hook(hook) for p in parameters if p.requires_grad]


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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_report = None
        self.pending = None   # the verdict the seam took this step
        self.max_norm = None  # the framework's clip of this step, done from the agreed norm
        self.clipped = False  # framework_norm: the framework clipped with its own norm already
        self.loss = None      # this step's micro-batch losses, summed (the step's mean loss)
        self.calls = 0        # step() calls: a framework's GradScaler may leave one out
        self.loss_expected = None  # what hands the loss, when one must reach every step
        self._unapplied = False
        self._clip = True

    def add_loss(self, loss):
        loss = loss.detach().float().reshape(())
        self.loss = loss if self.loss is None else self.loss + loss

    def take_verdict(self):
        if self.pending is None:
            self._check_loss_given()
            loss, self.loss = self.loss, None
            self.pending = self.verdict(loss)
        return self.pending

    def _check_loss_given(self):
        """A step whose loss never arrived, where a seam should have handed it, is an error (a
        framework that stopped calling that seam), not a verdict on the gradients alone."""
        if self.loss is None and self.loss_expected is not None:
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
        self.last_report = self._run(verdict, max_norm, loss)
        return self.last_report

    def _run(self, verdict, max_norm, loss):
        if self._unapplied:
            verdict = verdict if verdict is not None else self.take_verdict()
            self.pending = None
            return finish_step(self, verdict, update=lambda: False)
        if verdict is None:  # no seam call this step (a strategy or loop that steps otherwise)
            if loss is None:
                self._check_loss_given()
            given, self.loss = self.loss, None
            return GuardedOptimizer.step.__wrapped__(self, loss if loss is not None else given)
        return finish_step(self, verdict, max_norm, clip=self._clip)

    def _state_dict(self):
        return self.optimizer.state_dict()

    def _load_state_dict(self, state_dict):
        if "stepguard" in state_dict and "optimizer" in state_dict:  # a guard's own layout
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

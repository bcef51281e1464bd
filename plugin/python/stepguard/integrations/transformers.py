"""stepguard inside HF Transformers' ``Trainer`` (written against transformers 5.24, accelerate
1.15). What a user adds, with no change to the model or the training arguments::

    from stepguard.integrations.transformers import StepguardCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    StepguardCallback(policy="run.yaml").attach(trainer)
    trainer.train()

At ``on_train_begin`` the callback wraps the optimizer inside the Trainer's
``AcceleratedOptimizer`` in a ``GuardedOptimizer`` (over every rank of torch.distributed when it
runs several), so the Trainer's own ``optimizer.step()`` is the guarded step. A step the guard did
not apply (skipped, rolled back) is reported to the Trainer as accelerate reports a GradScaler
overflow (``accelerator.optimizer_step_was_skipped``), so the LR scheduler follows applied steps
only. Each log of the Trainer gets ``stepguard/grad_norm``, ``stepguard/applied``,
``stepguard/skipped``, ``stepguard/rolled_back``, ``stepguard/incidents``,
``stepguard/loss_scale`` and ``stepguard/lr_factor``; the entry in ``state.log_history`` also gets
``stepguard/outcome`` and ``stepguard/incident`` (step, signal, action, cause, origin ranks,
blamed tensors); the guard's logger (``stepguard``) says each incident once for the job (rank 0).

``attach(trainer)`` also hands the guard what no Trainer callback sees: each step's loss (the
sum of what ``training_step`` returns for its micro-batches, i.e. the mean micro-batch loss, as
the Trainer logs it), the checkpoint ``train(resume_from_checkpoint=...)`` resumes from, and,
under DDP or one process, the Trainer's clip (``max_grad_norm``): the guard's verdict is taken
in the Trainer's ``optimizer.step()``, after every ``on_pre_optimizer_step`` callback (a
gradient a callback changes there is judged), on the gradients unclipped (blame names the bad
tensor); its agreed norm is what the Trainer logs and clips with (the norm is computed once;
Inf or NaN on a step with non-finite gradients, as accelerate alone logs), and the clip runs
in the guarded step, on applied steps only, so after those callbacks (the Trainer alone clips
before them). After
``attach``, a step whose loss never reached the guard (a Trainer that no longer calls
``training_step``) raises before anything is judged or applied. Passed in
``Trainer(callbacks=[...])`` without ``attach``, the callback guards on the (already clipped)
gradients alone: no loss detectors, and a NaN anywhere reaches every tensor through the clip
coefficient.

The guard's state (``guard_state_dict()``) is saved in every Trainer checkpoint folder, one
``stepguard_rank<r>.pt`` per rank beside the Trainer's own files, and loaded on
``resume_from_checkpoint``: the LR factor, budgets, step numbers and data position go on (a
checkpoint without that file resumes with a fresh guard and a warning; anything there but a
regular file, a FIFO or a device, is refused with an error naming it). With several ranks,
``trace_path`` names rank 0's file; rank r writes ``<trace_path>.rank<r>``. The guard's own loss
scaling (``loss_scaling=True``) is refused (the Trainer never scales the loss by the guard's
scale); a policy's ``loss_scale`` section (a preset's) is taken as the Trainer's
scaler's and turns nothing of the guard's on.

fp16 (``TrainingArguments(fp16=True)``): accelerate's GradScaler owns the loss scale. The guard
judges the gradients the scaler unscaled, with the scaler's scale (the report's ``loss_scale``);
a step whose gradients overflow is skipped by the scaler's own path and the scale backs off and
grows by the scaler's rules; what the scale cannot fix (a NaN loss, the scale down to
``GRAD_SCALER_FLOOR``) goes by the policy.

DeepSpeed (``TrainingArguments(deepspeed=...)``, accelerate's DeepSpeed plugin): the callback hands
the Trainer's engine to ``stepguard.integrations.deepspeed`` at ``on_train_begin`` (what that
integration guards, it guards here: ZeRO 0-3, fp32, bf16, fp16 under ZeRO); the guard decides
inside the engine's step, which accelerate runs from the Trainer's backward, and a step it did not
apply takes DeepSpeed's own overflow path, which the Trainer reads as a skipped step. The step's
loss is the sum of the micro-batch losses the Trainer hands the engine (the Trainer's logged
loss); the guard's state goes in the same ``stepguard_rank<r>.pt`` beside DeepSpeed's checkpoint
in the Trainer's folder. ``attach()`` is needed there (the engine is the Trainer's), and a
DeepSpeed configuration the integration cannot guard (offload to NVMe or of the parameters, fp16
without ZeRO) is refused at ``attach()``.

Not covered: FSDP through the Trainer, the ``batches_to_skip`` of a rollback (the Trainer's data
iterator is out of reach; the batch of the bad step itself is dropped, and the callback says so
once per run).
"""

import math
import os

import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer, patch_optimizer_step
from accelerate.utils import DistributedType
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .. import _files
from .._port import is_dtensor
from ._core import (Figures, GradientWatch, SeamGuard, TrainerPort, check_version, guard_options,
                    is_off, load_guard_state, policy_clip_after, refuse_bypass, state_key,
                    unscale_once, with_sharding)
from ._seams import Patches, check_seams
from .deepspeed import check_config, guard_trainer_engine

logger = transformers.utils.logging.get_logger(__name__)

_INCIDENT_KEYS = ("step", "signal", "action", "cause", "ranks", "origin_unknown", "tensors",
                  "reason")


class _TrainerGuard(SeamGuard):
    """The guard inside the Trainer's AcceleratedOptimizer. With ``attach``, the Trainer's clip
    (``accelerator.clip_grad_norm_``) hands back a norm tensor (``deferred``) and the verdict is
    taken in the Trainer's ``optimizer.step()``, after every ``on_pre_optimizer_step`` callback,
    so that a gradient a callback changed there is judged; the verdict fills that tensor (the
    norm the Trainer logs), then the step clips, runs the update the verdict allows and
    settles."""

    deferred = None  # (parameters, the norm tensor the Trainer logs, framework_norm)
    framework = "the HF Trainer"  # its data order is out of reach (the default drops)

    def take_verdict(self):
        fresh = self.pending is None
        verdict = super().take_verdict()
        if fresh and self.deferred is not None:
            parameters, norm, framework_norm = self.deferred
            if verdict.nonfinite_count:
                # What accelerate alone logs for such a step (Inf or NaN stays visible).
                norm.copy_(torch.nn.utils.get_total_norm(
                    [p.grad for p in parameters if p.grad is not None]))
            elif not (framework_norm and verdict.applies):
                norm.fill_(verdict.grad_norm)
        return verdict

    def step(self, closure=None):
        if self.deferred is not None:
            verdict = self.take_verdict()
            parameters, norm, framework_norm = self.deferred
            self.deferred = None
            if framework_norm and verdict.applies and not self._unapplied:
                # accelerate's own norm and clip (torch's), the policy's clip after it.
                norm.copy_(torch.nn.utils.clip_grad_norm_(parameters, self.max_norm))
                policy_clip_after(parameters, self.max_norm, verdict)
                self.clipped = True
        return super().step(closure)

    def drop_pending(self):
        self.deferred = self._port.held_scale = None
        super().drop_pending()


def _state_file(checkpoint, rank):
    """The guard's state in a Trainer checkpoint folder: one file per rank, beside the
    Trainer's own per-rank ``rng_state_<r>.pth``."""
    return os.path.join(checkpoint, state_key(rank) + ".pt")


class StepguardCallback(transformers.TrainerCallback):
    """Guards every optimizer step of a ``transformers.Trainer``.

    Args:
        policy: a YAML policy path or a shipped preset's name (as ``GuardedOptimizer``).
        guard_options: the other ``GuardedOptimizer`` keywords (collective_timeout, trace_path,
            incident_dir, checkpoint_dir, ...). ``process_group`` defaults to
            ``torch.distributed.group.WORLD`` when torch.distributed runs several ranks.

    ``framework_norm=True``: the Trainer's clip computes its own norm (accelerate's; under
    DeepSpeed, DeepSpeed's), one more norm per step as without the guard, so a clean step is
    bitwise an unguarded Trainer's; by default it clips with the agreed norm (computed once; it
    can differ from the framework's fp32 norm in the last bits, and so, with a binding clip, the
    update).

    After ``on_train_begin``: ``guard`` (the ``GuardedOptimizer``) and ``last_report`` (the
    ``StepReport`` of the last step).
    """

    def __init__(self, policy=None, *, allow_untested_framework=False, framework_norm=False,
                 **guard_options):
        if not isinstance(framework_norm, bool):
            raise TypeError("stepguard: framework_norm must be a bool, got %s"
                            % type(framework_norm).__name__)
        self.framework_norm = framework_norm or is_off(guard_options)
        self.policy = policy
        self.allow_untested_framework = allow_untested_framework
        self.guard_options = guard_options
        self.guard = None
        self.last_report = None
        self._attached = False
        self._trainer = None      # the Trainer attach() patched
        self._patches = Patches()  # every attribute written on the Trainer's objects
        self._callbacks_before = None  # the Trainer's callback list before attach()
        self._watch = None        # the hook refusing a step that passes the guard by
        self._origin = GradientWatch()  # the hooks naming a fault's origin rank (DDP)
        self._overflow_before = None  # the AcceleratedOptimizer's _is_overflow before the guard
        self._seams_checked = False
        self._incidents = []     # since the last log
        self._logged_step = None
        self._resume_from = None  # the checkpoint folder train() resumes from
        self._figures = None
        self._optimizer = None    # the Trainer's AcceleratedOptimizer
        self._engine_guard = None  # under DeepSpeed: the guard inside the Trainer's engine
        self._seen_report = None  # under DeepSpeed: the engine guard's report handled last

    def _check_seams(self):
        """The transformers and accelerate functions the integration relies on are the tested
        releases' (stepguard.integrations._seams); once per callback."""
        if not self._seams_checked:
            check_seams("transformers", self.allow_untested_framework)
            self._seams_checked = True

    def attach(self, trainer):
        """Adds the callback to ``trainer`` (first, so that reporters see its log entries) and
        hands the guard each step's loss and, under DDP or one process, the gradient clipping.
        Call it once, before ``trainer.train()``; returns the callback. ``detach()`` undoes it.
        Refused when the framework functions it relies on differ from the tested releases'
        (``allow_untested_framework=True`` runs anyway, with a warning), and on a Trainer that
        another StepguardCallback is attached to."""
        if self._attached:
            if trainer is self._trainer:
                return self
            raise RuntimeError("stepguard: this StepguardCallback is attached to another Trainer; "
                               "detach() it first, or give each Trainer a callback of its own")
        other = getattr(vars(trainer).get("training_step"), "stepguard_callback", None)
        if other is not None:
            raise RuntimeError("stepguard: this Trainer has a StepguardCallback attached already "
                               "(one guard per Trainer); detach() that one first")
        self._check_seams()
        if getattr(trainer, "is_deepspeed_enabled", False):
            # What the DeepSpeed configuration alone shows cannot be guarded, said now rather
            # than at the first step (the engine itself is checked at on_train_begin).
            check_version("deepspeed")
            check_config(trainer.accelerator.state.deepspeed_plugin.deepspeed_config)
        handler = trainer.callback_handler
        self._callbacks_before = list(handler.callbacks)
        if self in handler.callbacks:
            handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)
        training_step = trainer.training_step

        def guarded_training_step(*args, **kwargs):
            # The loss of each micro-batch (no callback event carries it).
            loss = training_step(*args, **kwargs)
            if torch.is_tensor(loss) and isinstance(self.guard, _TrainerGuard):
                self.guard.add_loss(loss)  # (under DeepSpeed the engine's backward hands it)
            return loss

        guarded_training_step.stepguard_callback = self
        self._patches.set(trainer, "training_step", guarded_training_step)
        train = trainer.train

        def guarded_train(resume_from_checkpoint=None, *args, **kwargs):
            # The folder the Trainer resumes from, which no callback event names: the guard's
            # state is loaded from it at on_train_begin (True: the newest in output_dir).
            checkpoint = resume_from_checkpoint
            if isinstance(checkpoint, bool):
                checkpoint = get_last_checkpoint(trainer.args.output_dir) if checkpoint else None
            self._resume_from = checkpoint
            return train(resume_from_checkpoint, *args, **kwargs)

        self._patches.set(trainer, "train", guarded_train)
        self._clip_seam(trainer.accelerator)
        self._attached = True
        self._trainer = trainer
        return self

    def _clip_seam(self, accelerator):
        """The Trainer measures the norm in ``accelerator.clip_grad_norm_`` (and logs its
        result): the guard's verdict there instead (DDP and one process)."""
        kind = accelerator.distributed_type
        if kind == DistributedType.NO or kind.value.startswith("MULTI_"):
            clip_grad_norm_ = accelerator.clip_grad_norm_

            def clip_from_verdict_(parameters, max_norm, norm_type=2):
                # The Trainer measures the norm here (accelerator.clip_grad_norm_, whose result it
                # logs): the guard's verdict instead, its agreed norm returned; the clip itself
                # runs in the guarded step, on applied steps only.
                parameters = list(parameters)
                guard = self.guard
                if (guard is None or norm_type != 2
                        or any(is_dtensor(p.grad) for p in parameters if p.grad is not None)):
                    return clip_grad_norm_(parameters, max_norm, norm_type)
                if guard.pending is None and self._optimizer.scaler is not None:
                    unscale_once(self._optimizer.scaler, guard)  # as accelerate's clip does
                    guard._port.hold_scale()  # the backward's, for a verdict after update()
                # The verdict in the Trainer's optimizer.step(), after the callbacks' changes.
                guard.max_norm = max_norm
                device = parameters[0].device if parameters else None
                guard.deferred = (parameters, torch.full((), math.nan, device=device),
                                  self.framework_norm)
                return guard.deferred[1]

            self._patches.set(accelerator, "clip_grad_norm_", clip_from_verdict_)

    def detach(self):
        """Undoes ``attach()`` and what ``train()`` set up: every attribute the callback wrote on
        the Trainer, its accelerator and its AcceleratedOptimizer is put back (the optimizer
        steps unguarded again), the hook on the wrapped optimizer is removed and the callback
        leaves the Trainer's list. ``guard`` keeps its state: a later ``attach()`` and
        ``train()`` guard on with it. Returns the callback."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        self._origin.remove()
        if self._optimizer is not None and self._overflow_before is not None:
            self._optimizer._is_overflow = self._overflow_before
        if self._engine_guard is not None:
            self._engine_guard.detach()
        self._patches.restore()
        if self._trainer is not None:
            callbacks = self._trainer.callback_handler.callbacks
            callbacks[:] = [c for c in callbacks if c is not self]
            if self._callbacks_before is not None and self in self._callbacks_before:
                callbacks.insert(self._callbacks_before.index(self), self)
        self._attached = False
        self._trainer = None
        self._optimizer = None
        return self

    # -- the Trainer's events -----------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        check_version("transformers")
        check_version("accelerate")
        if type(optimizer).__name__ == "DeepSpeedOptimizerWrapper":
            self._guard_engine(args, optimizer)
            return
        if self._engine_guard is not None:  # a DeepSpeed train() before this one's
            self._engine_guard.detach()
            self._engine_guard = None
        if type(optimizer) is not AcceleratedOptimizer:
            raise TypeError(
                "stepguard: StepguardCallback guards the Trainer's AcceleratedOptimizer; got %s "
                "(DeepSpeed through the Trainer is not covered: see "
                "stepguard.integrations.deepspeed)" % type(optimizer).__name__)
        if not (isinstance(getattr(AcceleratedOptimizer, "step_was_skipped", None), property)
                and hasattr(optimizer, "_is_overflow")):
            raise TypeError(
                "stepguard: this accelerate's AcceleratedOptimizer has no step_was_skipped / "
                "_is_overflow (accelerate 1.15 has them): the Trainer could not be told that a "
                "step was not applied, and its LR schedule would move on skipped steps")
        self._check_seams()
        if optimizer is not self._optimizer:
            self._overflow_before = getattr(optimizer, "_is_overflow", None)
        self._optimizer = optimizer
        if isinstance(optimizer.optimizer, _TrainerGuard):  # a second train() on this Trainer
            self.guard = optimizer.optimizer
            self.guard.drop_pending()
            self.guard.core.loss.clear()
            self._load_guard_state(args)
            self._figures = Figures(self.guard)
            return
        scaler = optimizer.scaler
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError("stepguard: fp16 with a %s; the integration follows accelerate's "
                             "torch.amp.GradScaler" % type(scaler).__name__)
        if scaler is not None:
            check_seams("torch", self.allow_untested_framework)
        if self.guard is None or self.guard.optimizer is not optimizer.optimizer:
            named = list(model.named_parameters())
            options = guard_options(self.guard_options, self.policy)
            port = TrainerPort(optimizer.optimizer, named, scaler,
                               layout=options.pop("layout", None))
            self.guard = _TrainerGuard(optimizer.optimizer, named, port=port,
                                       **with_sharding(options, optimizer.optimizer))
        else:  # attached again after detach(): the same guard, its state kept
            self.guard.drop_pending()
            self.guard.core.loss.clear()
        if self._watch is not None:
            self._watch.remove()
        self._watch = refuse_bypass(self.guard, "the HF Trainer")
        self._origin.install(self.guard, model.parameters())
        self._patches.set(optimizer, "optimizer", self.guard)
        if scaler is not None:
            # fp16: the AcceleratedOptimizer steps through scaler.step() the step method it took
            # at setup (the wrapped optimizer's); the guard's instead.
            self._patches.set(optimizer, "_optimizer_original_step_method", self.guard.step)
            self._patches.set(optimizer, "_optimizer_patched_step_method",
                              patch_optimizer_step(optimizer, self.guard.step))
        self._load_guard_state(args)
        self._figures = Figures(self.guard)
        self.guard.loss_expected = ("callback.attach(trainer) hands the guard each micro-batch's "
                                    "loss through trainer.training_step"
                                    if self._attached else None)
        if not self._attached:
            logger.warning("stepguard: StepguardCallback was not attached to the Trainer "
                           "(callback.attach(trainer)): the guard sees no loss, so its loss "
                           "detectors are off, and it sees the gradients after clipping")

    def _guard_engine(self, args, optimizer):
        """DeepSpeed through the Trainer: the DeepSpeed integration's guard in its engine (the
        same one again on a later train() of this engine; its state carried to a new one)."""
        if self._trainer is None:
            raise RuntimeError(
                "stepguard: the Trainer runs DeepSpeed: call callback.attach(trainer) before "
                "train() (the guard goes inside the Trainer's DeepSpeed engine)")
        self._engine_guard = guard_trainer_engine(self._trainer.model_wrapped,
                                                  self._engine_guard, self.policy,
                                                  self.guard_options, "the HF Trainer",
                                                  framework_norm=self.framework_norm,
                                                  allow_untested_framework=(
                                                      self.allow_untested_framework))
        # accelerate's wrapper tells the Trainer a step was skipped from the engine optimizer's
        # `overflow` only if it had one at prepare(); without ZeRO the guard gives it one.
        self._patches.set(optimizer, "__has_overflow__", True)
        self.guard = self._engine_guard.guard
        self._seen_report = self._engine_guard.last_report
        self._load_guard_state(args)
        self._figures = Figures(self.guard)

    def _load_guard_state(self, args):
        """The guard's state from the checkpoint train() resumes from, on every rank."""
        checkpoint, self._resume_from = self._resume_from, None
        if checkpoint is None:
            return
        path = _state_file(checkpoint, self.guard.stats().rank)
        try:
            record = _files.load_torch(path, _files.MAX_GUARD_STATE_BYTES)
        except FileNotFoundError:
            record = None  # a checkpoint saved without stepguard (load_guard_state warns)
        # Anything else at that name (a FIFO, a device, a folder) raises FileError naming it: a
        # damaged checkpoint is said, not resumed from as if the guard had never run.
        load_guard_state(self.guard, record, checkpoint)

    def on_save(self, args, state, control, **kwargs):
        # After the Trainer wrote checkpoint-<global_step> (every rank runs this event): the
        # guard's state goes beside it, written whole then renamed into place (never through a
        # link planted at either name).
        if self.guard is None:
            return
        folder = os.path.join(args.output_dir, "%s-%d" % (PREFIX_CHECKPOINT_DIR, state.global_step))
        if not os.path.isdir(folder):
            return
        path = _state_file(folder, self.guard.stats().rank)
        _files.save_torch(self.guard.guard_state_dict(), path)

    def _take_verdict(self):
        """The step's verdict, taken once, on the gradients unscaled: under fp16 accelerate's
        GradScaler unscales them first (as accelerate's clip_grad_norm_ does)."""
        guard = self.guard
        if guard.pending is None and self._optimizer.scaler is not None:
            unscale_once(self._optimizer.scaler, guard)  # accelerate's clip may have unscaled
        return guard.take_verdict()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.guard is not None and self._engine_guard is None:
            self.guard.last_report = None
            if self._optimizer.scaler is not None and self.guard.deferred is None:
                # fp16: the scaler calls the guard's step on finite gradients only; the verdict
                # is taken here when the clip did not hand it to the step.
                self._take_verdict()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.guard is None:
            return
        if self._engine_guard is not None:
            # DeepSpeed: the engine stepped inside the Trainer's backward (accelerate's
            # DeepSpeedEngineWrapper); a step the guard did not apply took DeepSpeed's overflow
            # path, which the Trainer reads (DeepSpeedOptimizerWrapper.step_was_skipped).
            report = self._engine_guard.last_report
            if report is None or report is self._seen_report:
                return
            self._seen_report = report
        else:
            report, self.guard.last_report = self.guard.last_report, None
            if report is None and (self.guard.pending is not None
                                   or self.guard.deferred is not None):
                # fp16: accelerate's GradScaler found Inf or NaN on this rank and left the
                # guard's step out (it backed the scale off); the guard's decision is carried
                # out now.
                report = self.guard.step_the_scaler_skipped()
                self.guard.last_report = None
            if report is None:  # the AcceleratedOptimizer did not step
                return
            # Trainer reads accelerator.optimizer_step_was_skipped, i.e. AcceleratedOptimizer.
            # step_was_skipped, which returns this attribute (set by accelerate for a
            # GradScaler overflow), to leave the LR scheduler alone on this step.
            optimizer._is_overflow = not report.applied
        self.last_report = report
        self._figures.update(report)
        if report.incident is not None:  # (the guard's logger says it, once for the job)
            self._incidents.append({k: report.incident.get(k) for k in _INCIDENT_KEYS})
        if report.aborted:
            logger.error("stepguard: the guard aborted training at step %d (%s)",
                         report.step, ", ".join(report.actions))
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        report = self.last_report
        if report is None or logs is None or report.step == self._logged_step:
            return
        self._logged_step = report.step
        # From the reports: stats() would wait for the snapshot copy the step just began.
        figures = self._figures.step_figures()
        extra = {"stepguard/" + key: figures[key]
                 for key in ("grad_norm", "loss_scale", "lr_factor", "applied", "skipped",
                             "rolled_back", "incidents")}
        logs.update(extra)  # numbers only: every reporter takes them
        # Trainer.log() appended a copy of logs to log_history before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            entry = state.log_history[-1]
            entry.update(extra)
            entry["stepguard/outcome"] = report.outcome
            if self._incidents:
                entry["stepguard/incident"] = list(self._incidents)
        self._incidents = []

    def on_train_end(self, args, state, control, **kwargs):
        if self.guard is not None and not self.guard.stats().aborted:
            self.guard.commit_pending_checkpoint()

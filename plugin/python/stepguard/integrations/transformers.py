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
blamed tensors), and every rank logs a warning line per incident.

``attach(trainer)`` also hands the guard what no Trainer callback sees: each step's loss (the
sum of what ``training_step`` returns for its micro-batches, i.e. the mean micro-batch loss, as
the Trainer logs it) and, under DDP or one process, the gradient clipping (``max_grad_norm``):
the Trainer still gets and logs the pre-clip norm, and the gradients are clipped inside the
guarded step, after the verdict, so that the guard judges (and blames) the gradients as backward
left them. Passed in ``Trainer(callbacks=[...])`` without ``attach``, the callback guards on the
(already clipped) gradients alone: no loss detectors, and a NaN anywhere reaches every tensor
through the clip coefficient.

Not covered: fp16 with accelerate's GradScaler (refused: use bf16, or the guard's own loss
scaling), DeepSpeed and FSDP through the Trainer, the ``batches_to_skip`` of a rollback (the
Trainer's data iterator is out of reach; the batch of the bad step itself is dropped), and the
guard's own state in Trainer checkpoints (``optimizer.pt`` keeps the wrapped optimizer's format;
on resume the guard starts afresh).
"""

import math

import torch
import torch.distributed as dist
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from .._guard import GuardedOptimizer
from .._port import TorchOptimPort, is_dtensor

logger = transformers.utils.logging.get_logger(__name__)

_INCIDENT_KEYS = ("step", "signal", "action", "cause", "ranks", "tensors", "reason")


class _TrainerPort(TorchOptimPort):
    """The wrapped optimizer's step, with the Trainer's gradient clipping in front of it when
    ``attach`` handed the clipping to the guard."""

    clip = None  # (parameters, max_norm, total_norm) measured for this step by the Trainer

    def update(self):
        clip, self.clip = self.clip, None
        if clip is not None and math.isfinite(clip[1]):
            torch.nn.utils.clip_grads_with_norm_(*clip)
        super().update()


class _TrainerGuard(GuardedOptimizer):
    """The guard inside the Trainer's AcceleratedOptimizer: it keeps the report the Trainer
    drops, and saves and loads as the wrapped optimizer does (Trainer checkpoints keep their
    format and load with or without stepguard)."""

    last_report = None

    def step(self, closure=None):
        self.last_report = super().step(closure)
        return self.last_report

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)


def _incident_line(incident):
    return ("stepguard: step %s: %s -> %s (cause %s) from rank(s) %s; tensors: %s"
            % (incident.get("step"), incident.get("signal"), incident.get("action"),
               incident.get("cause"), incident.get("ranks"),
               ", ".join(incident.get("tensors") or []) or "-"))


class StepguardCallback(transformers.TrainerCallback):
    """Guards every optimizer step of a ``transformers.Trainer``.

    Args:
        policy: a YAML policy path or a shipped preset's name (as ``GuardedOptimizer``).
        guard_options: the other ``GuardedOptimizer`` keywords (collective_timeout, trace_path,
            incident_dir, checkpoint_dir, ...). ``process_group`` defaults to
            ``torch.distributed.group.WORLD`` when torch.distributed runs several ranks.

    After ``on_train_begin``: ``guard`` (the ``GuardedOptimizer``) and ``last_report`` (the
    ``StepReport`` of the last step).
    """

    def __init__(self, policy=None, **guard_options):
        self.policy = policy
        self.guard_options = guard_options
        self.guard = None
        self.last_report = None
        self._port = None
        self._attached = False
        self._loss = None        # this step's loss so far (sum over its micro-batches)
        self._incidents = []     # since the last log
        self._logged_step = None

    def attach(self, trainer):
        """Adds the callback to ``trainer`` (first, so that reporters see its log entries) and
        hands the guard each step's loss and, under DDP or one process, the gradient clipping.
        Call it once, before ``trainer.train()``; returns the callback."""
        if self._attached:
            return self
        handler = trainer.callback_handler
        if self in handler.callbacks:
            handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)
        training_step = trainer.training_step

        def guarded_training_step(*args, **kwargs):
            loss = training_step(*args, **kwargs)
            if torch.is_tensor(loss):
                loss = loss.detach().float().reshape(())
                self._loss = loss if self._loss is None else self._loss + loss
            return loss

        trainer.training_step = guarded_training_step
        accelerator = trainer.accelerator
        kind = accelerator.distributed_type
        if kind == DistributedType.NO or kind.value.startswith("MULTI_"):
            clip_grad_norm_ = accelerator.clip_grad_norm_

            def measure_grad_norm_(parameters, max_norm, norm_type=2):
                parameters = list(parameters)
                params = [p for p in parameters if p.grad is not None]
                if self._port is None or any(is_dtensor(p.grad) for p in params):
                    return clip_grad_norm_(parameters, max_norm, norm_type)
                total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
                self._port.clip = (params, max_norm, total)  # clipped in the guarded step
                return total

            accelerator.clip_grad_norm_ = measure_grad_norm_
        self._attached = True
        return self

    # -- the Trainer's events -----------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if type(optimizer) is not AcceleratedOptimizer:
            raise TypeError(
                "stepguard: StepguardCallback guards the Trainer's AcceleratedOptimizer; got %s "
                "(DeepSpeed through the Trainer is not covered: see "
                "stepguard.integrations.deepspeed)" % type(optimizer).__name__)
        if optimizer.scaler is not None:
            raise ValueError(
                "stepguard: fp16 with accelerate's GradScaler is not supported: its scaler skips "
                "overflowing steps before the guard sees them; train in bf16 or fp32 (the "
                "guard's policy can own an fp16 loss scale when the loop is yours)")
        self._loss = None
        if isinstance(optimizer.optimizer, _TrainerGuard):  # a second train() on this Trainer
            self.guard = optimizer.optimizer
            self._port = self.guard._port
            return
        options = dict(self.guard_options)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            options.setdefault("process_group", dist.group.WORLD)
        self._port = _TrainerPort(optimizer.optimizer, model.named_parameters())
        self.guard = _TrainerGuard(optimizer.optimizer, port=self._port, policy=self.policy,
                                   **options)
        optimizer.optimizer = self.guard
        if not self._attached:
            logger.warning("stepguard: StepguardCallback was not attached to the Trainer "
                           "(callback.attach(trainer)): the guard sees no loss, so its loss "
                           "detectors are off, and it sees the gradients after clipping")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.guard is None:
            return
        self.guard.last_report = None
        if self._loss is not None:
            self.guard.record_loss(self._loss)
            self._loss = None

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.guard is None:
            return
        report, self.guard.last_report = self.guard.last_report, None
        if self._port is not None:
            self._port.clip = None
        if report is None:  # the AcceleratedOptimizer did not step
            return
        self.last_report = report
        # accelerate's step_was_skipped: the Trainer leaves the LR scheduler alone on this step
        optimizer._is_overflow = not report.applied
        if report.incident is not None:
            incident = {k: report.incident.get(k) for k in _INCIDENT_KEYS}
            self._incidents.append(incident)
            logger.warning(_incident_line(incident))
        if report.aborted:
            logger.error("stepguard: the guard aborted training at step %d (%s)",
                         report.step, ", ".join(report.actions))
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        report = self.last_report
        if report is None or logs is None or report.step == self._logged_step:
            return
        self._logged_step = report.step
        stats = self.guard.stats()  # one read for every figure
        totals = stats.totals.to_dict()
        extra = {"stepguard/grad_norm": report.grad_norm,
                 "stepguard/loss_scale": stats.loss_scale,
                 "stepguard/lr_factor": stats.lr_factor}
        for key in ("applied", "skipped", "rolled_back", "incidents"):
            extra["stepguard/" + key] = totals.get(key, 0)
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

"""stepguard in a Lightning ``Trainer``: add one callback, change nothing in the model.

    from stepguard.integrations.lightning import StepguardCallback

    trainer = lightning.pytorch.Trainer(..., callbacks=[StepguardCallback(policy="run.yaml")])

At fit start (after Lightning has set up DDP and called ``configure_optimizers``) the callback
wraps each of the trainer's optimizers in a ``GuardedOptimizer`` with the LightningModule's
parameter names, the module's buffers tracked, and ``process_group=dist.group.WORLD`` when
several ranks run. Lightning then steps the guard as it stepped the optimizer
(``optimizer.step(closure=...)``: training_step, backward, then the guarded step), so every rank
applies, skips or rolls back the step together. A step the guard did not apply does not move the
step-interval LR schedulers, and after a rollback the batches the policy says to drop
(``skip_batches``) are run but not stepped. Each step's figures reach the trainer's loggers
through ``pl_module.log`` (``stepguard/grad_norm``...); each incident is logged on rank 0 as one
line naming its ranks and tensors. Imports Lightning (``lightning.pytorch``, else
``pytorch_lightning``) when this module is imported; ``import stepguard`` never does.
"""

import logging
from typing import Any, Dict, List, Optional

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package of older installs
    try:
        import pytorch_lightning as pl
    except ImportError as e:
        raise ImportError("stepguard.integrations.lightning needs Lightning: pip install lightning "
                          "(or pytorch_lightning)") from e

from .._guard import GuardedOptimizer

__all__ = ["StepguardCallback", "OUTCOME_CODES"]

log = logging.getLogger(__name__)

#: ``stepguard/outcome`` as logged: the report's outcome as a number ("dropped": a batch after a
#: rollback that was run but not stepped, as the policy's ``skip_batches`` says).
OUTCOME_CODES = {"applied": 0, "skipped": 1, "rolled_back": 2, "aborted": 3, "dropped": 4}


class _LightningGuard(GuardedOptimizer):
    """The guard Lightning steps. ``step`` takes Lightning's closure (whose result is None under
    manual optimization: the guard then goes on the gradients, or a loss given to
    ``record_loss``), remembers the report and drops the batches a rollback asks to drop.
    ``state_dict`` is the wrapped optimizer's, so Lightning checkpoints load with or without the
    callback; the guard's own state travels in the callback's state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_report = None
        self.held_back = False    # the last step was not applied: step schedulers hold still
        self.fresh = False        # a step happened since the callback last logged
        self.to_drop = 0
        self.dropped = 0

    def step(self, closure: Any = None) -> Any:
        loss = closure
        if callable(closure) and not torch.is_tensor(closure):
            with torch.enable_grad():
                loss = closure()  # Lightning's: training_step, zero_grad, backward (it must run)
            if not torch.is_tensor(loss):
                loss = None
        self.fresh = True
        self.held_back = True
        if self.to_drop > 0:
            self.to_drop -= 1
            self.dropped += 1
            self.last_report = None
            self.zero_grad()
            return None
        report = super().step(loss)
        self.last_report = report
        self.held_back = not report.applied
        self.to_drop += report.batches_to_skip
        return report

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "stepguard" in state_dict and "optimizer" in state_dict:
            super().load_state_dict(state_dict)
        else:
            self.optimizer.load_state_dict(state_dict)


class StepguardCallback(pl.Callback):
    """Guards every optimizer step of ``Trainer.fit``; the user adds
    ``callbacks=[StepguardCallback(policy=...)]`` to the Trainer.

    Args:
        policy: a YAML policy path or a shipped preset's name (as ``GuardedOptimizer``).
        log_metrics: log each step's figures with ``pl_module.log`` (on step, so as often as
            ``Trainer(log_every_n_steps=...)`` writes): ``stepguard/outcome`` (``OUTCOME_CODES``),
            ``applied`` (1/0), ``grad_norm``, ``nonfinite_count``, ``loss_scale``, ``lr_factor``
            and the running counts ``skipped``, ``rolled_back``, ``incidents``, ``dropped``
            (a dropped batch logs NaN for the figures it has none of). With several optimizers
            (manual optimization) the keys are ``stepguard/<i>/...``.
        **guard_options: any other ``GuardedOptimizer`` keyword (trace_path, incident_dir,
            collective_timeout, metrics_port, ...); ``process_group`` defaults to WORLD when
            torch.distributed runs several ranks.

    After ``fit``: ``guards`` (e.g. ``guards[0].stats().totals``) and ``incidents`` (each incident's
    dict, on every rank). An aborted step stops the trainer (``should_stop``). Under manual
    optimization ``opt.step()`` returns the ``StepReport``; step your schedulers when
    ``report.applied``. Precision '32-true' or 'bf16-mixed': '16-mixed' (a GradScaler) and the
    guard's own loss scaling are refused. Gradient clipping (``gradient_clip_val``) runs inside
    Lightning's closure, before the guard looks at the gradients.
    """

    def __init__(self, policy: Optional[str] = None, *, log_metrics: bool = True,
                 **guard_options: Any) -> None:
        self.policy = policy
        self.log_metrics = log_metrics
        self.guard_options = guard_options
        self.guards: List[_LightningGuard] = []
        self.incidents: List[Dict[str, Any]] = []
        self._records: Optional[List[Dict[str, Any]]] = None  # from a checkpoint, for on_fit_start
        self._patched: Optional[pl.LightningModule] = None

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError("stepguard: precision='16-mixed' runs a GradScaler that skips steps "
                             "behind the guard; use '32-true' or 'bf16-mixed'")
        options = dict(self.guard_options)
        dist = torch.distributed
        if (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            options.setdefault("process_group", dist.group.WORLD)
        if self.policy is not None:
            options["policy"] = self.policy
        named = list(pl_module.named_parameters())  # the module's names, not DDP's "module."
        guards = []
        for optimizer in trainer.strategy.optimizers:
            if isinstance(optimizer, GuardedOptimizer) and not isinstance(optimizer,
                                                                          _LightningGuard):
                raise ValueError("stepguard: configure_optimizers returned a GuardedOptimizer; "
                                 "return the plain optimizer, StepguardCallback wraps it")
            if not isinstance(optimizer, _LightningGuard):
                optimizer = _LightningGuard(optimizer, named, **options)
                if optimizer.stats().loss_scale != 1.0:
                    raise ValueError("stepguard: the guard's loss scaling (loss_scaling=True or a "
                                     "policy loss_scale section) is not supported under "
                                     "Lightning: its backward does not scale the loss")
                optimizer.track_buffers(pl_module.named_buffers())
            guards.append(optimizer)
        if self._records is not None:
            for guard, record in zip(guards, self._records):
                guard._guard.load_record(record)
            self._records = None
        trainer.strategy.optimizers = guards  # Lightning wraps each in a fresh LightningOptimizer
        self.guards = guards
        self._hold_schedulers(trainer, pl_module)

    def _hold_schedulers(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Lightning steps schedulers by calling the module's lr_scheduler_step hook (the user's
        # override included) after the optimizer step; an instance attribute in front of it lets
        # a step-interval scheduler move only when its optimizer's step was applied.
        pl_module.__dict__.pop("lr_scheduler_step", None)  # left by a fit that failed
        original = pl_module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if not self._holds(trainer, scheduler):
                original(scheduler, metric)

        pl_module.lr_scheduler_step = lr_scheduler_step
        self._patched = pl_module

    def _holds(self, trainer: "pl.Trainer", scheduler: Any) -> bool:
        configs = [c for c in trainer.lr_scheduler_configs if c.scheduler is scheduler]
        if configs and configs[0].interval != "step":
            return False  # epoch schedulers count epochs, not steps
        target = getattr(scheduler, "optimizer", None)
        for guard in self.guards:
            if target is guard or target is guard.optimizer:
                return guard.held_back
        return False

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        for i, guard in enumerate(self.guards):
            if not guard.fresh:
                continue  # accumulating gradients: no step this batch
            guard.fresh = False
            report = guard.last_report
            if report is not None and report.incident is not None:
                self._incident(trainer, report)
            if report is not None and report.aborted:
                log.error("stepguard: step %d aborted training: %s", report.step,
                          (report.incident or {}).get("reason", ""))
                trainer.should_stop = True
            if self.log_metrics:
                prefix = "stepguard/" if len(self.guards) == 1 else "stepguard/%d/" % i
                metrics = self._metrics(guard, report)
                pl_module.log_dict({prefix + k: float(v) for k, v in metrics.items()},
                                   on_step=True, on_epoch=False, batch_size=1)

    @staticmethod
    def _metrics(guard: _LightningGuard, report: Any) -> Dict[str, float]:
        stats = guard.stats()  # one read for every figure
        totals = stats.totals.to_dict()
        # A dropped batch has no measured figures: NaN, not the last step's (which Lightning
        # would otherwise log again).
        nan = float("nan")
        out = {"outcome": OUTCOME_CODES["dropped"], "applied": 0, "grad_norm": nan,
               "nonfinite_count": nan, "loss_scale": stats.loss_scale,
               "lr_factor": stats.lr_factor}
        if report is not None:
            out.update(outcome=OUTCOME_CODES.get(report.outcome, -1), applied=report.applied,
                       grad_norm=report.grad_norm, nonfinite_count=report.nonfinite_count,
                       loss_scale=report.loss_scale, lr_factor=report.lr_factor)
        out.update(skipped=totals["skipped"], rolled_back=totals["rolled_back"],
                   incidents=totals["incidents"], dropped=guard.dropped)
        return out

    def _incident(self, trainer: "pl.Trainer", report: Any) -> None:
        incident = dict(report.incident)
        self.incidents.append(incident)
        if trainer.is_global_zero:
            ranks = ",".join(str(r) for r in incident.get("ranks", []))
            ranks = "rank " + ranks if ranks else "no single rank"
            tensors = ", ".join(incident.get("tensors", [])) or "-"
            log.warning("stepguard: step %d %s: %s -> %s (cause %s) from %s; tensors: %s",
                        report.step, report.outcome, incident.get("signal"),
                        incident.get("action"), incident.get("cause"), ranks, tensors)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                 stage: str) -> None:
        if self._patched is not None:
            self._patched.__dict__.pop("lr_scheduler_step", None)
            self._patched = None

    # The guard's decision state (detector statistics, LR factor, loss scale, counts) rides in
    # the checkpoint as this callback's state; the optimizer state stays plain.
    def state_dict(self) -> Dict[str, Any]:
        return {"records": [guard._guard.record() for guard in self.guards]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._records = list(state_dict.get("records", [])) or None

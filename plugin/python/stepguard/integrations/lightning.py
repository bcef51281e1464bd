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
through ``pl_module.log`` (``stepguard/grad_norm``...); each incident is logged once for the job
(rank 0) by the guard's logger, ``stepguard``, naming its ranks and tensors.

Under ``DeepSpeedStrategy`` the callback hands the strategy's engine to
``stepguard.integrations.deepspeed`` at train start (after Lightning restored a checkpoint into
the engine): the guard decides inside the engine's step, a step it did not apply takes
DeepSpeed's own overflow path and holds the step schedulers, the step's loss is the sum of the
micro-batch losses Lightning hands ``engine.backward``, and the guard's state rides in the
callback's state inside DeepSpeed's checkpoint. A DeepSpeed configuration the integration cannot
guard (offload to NVMe or of the parameters, fp16 without ZeRO, MoE) is refused at fit
start. Imports Lightning (``lightning.pytorch``, else ``pytorch_lightning``) when this module is
imported; ``import stepguard`` never does.
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
from ._core import (OUTCOME_CODES, RUN_NOT_STEPPED, Figures, GradientWatch, SeamGuard,
                    TrainerPort, check_version,
                    guard_options, is_off, load_guard_state, policy_clip_after,
                    refuse_bypass, scaled_loss_unscaled, scaler_unscaled, with_sharding)
from ._seams import Patches, check_seams
from .deepspeed import _check_engine, check_config, guard_trainer_engine

__all__ = ["StepguardCallback", "OUTCOME_CODES"]

log = logging.getLogger(__name__)


class _LightningGuard(SeamGuard):
    """The guard Lightning steps. The step's verdict is taken after every
    ``on_before_optimizer_step`` (the callbacks' and the LightningModule's own): in Lightning's
    gradient clip when one is configured, else once Lightning's closure returned, with the loss
    of the step's micro-batches (``on_before_backward``); then the update the verdict allows
    (Lightning's clip from the agreed norm, the wrapped optimizer's step) and the settle. It
    also drops the batches a rollback asks to drop and tells the step schedulers to hold still
    after a step not applied."""

    framework = "Lightning"
    drops = RUN_NOT_STEPPED  # Lightning draws them; their steps are left out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held_back = False    # the last step was not applied: step schedulers hold still
        self.fresh = False        # a step happened since the callback last logged
        self.figures = Figures(self)

    @property
    def dropping(self) -> bool:
        """This batch is one a rollback drops."""
        return self.core.batches.pending > 0

    @property
    def dropped(self) -> int:
        """The batches dropped so far (run, not stepped)."""
        return self.core.batches.dropped

    def take_verdict(self) -> Any:
        return None if self.dropping else super().take_verdict()

    def _run(self, verdict: Any, max_norm: Any, loss: Any) -> Any:
        self.fresh = True
        self.held_back = True
        if verdict is None and not self.dropping and not self._unapplied:
            # No clip took it: the verdict now, after the closure and every hook, on the loss
            # of the step's micro-batches.
            verdict, self.pending = self.take_verdict(), None
        if self.core.batches.take():
            self.core.loss.clear()
            self.figures.update(None)
            self.zero_grad()
            return None
        report = super()._run(verdict, max_norm, loss)
        self.figures.update(report)
        self.held_back = not report.applied
        return report


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
    dict, on every rank); ``last_report``: the newest step's ``StepReport`` (None for a batch a
    rollback dropped). An aborted step stops the trainer (``should_stop``). Under manual
    optimization ``opt.step()`` returns the ``StepReport``; step your schedulers when
    ``report.applied``. Precision '32-true', 'bf16-mixed' or '16-mixed'. Under '16-mixed'
    Lightning's GradScaler owns the loss scale: the guard judges the unscaled gradients with the
    scaler's scale (its report's ``loss_scale``), an overflow is skipped by the scaler's own path
    and the scale backs off and grows by the scaler's rules; what the scale cannot fix (a NaN
    loss, the scale down to ``GRAD_SCALER_FLOOR``) goes by the policy (rollback, LR, abort).
    The guard's own loss scaling (``loss_scaling=True``) is refused; a policy's ``loss_scale``
    section (the ``megatron`` and ``deepspeed-fp16`` presets have one) is taken as Lightning's
    scaler's, turning nothing of the guard's on. The guard judges the gradients the update applies:
    after every ``on_before_optimizer_step`` (the LightningModule's own included: a change made
    there is judged), before Lightning's gradient clip; the clip by norm
    (``gradient_clip_val``, or ``self.clip_gradients`` in ``configure_gradient_clipping``) then
    uses the guard's agreed norm instead of computing it again, and runs only on steps the guard
    applies. ``framework_norm=True``: Lightning computes its own norm for its clip (one more
    norm per step, as without the guard; under DeepSpeedStrategy, DeepSpeed's), so a clean step
    is bitwise an unguarded run's; the agreed norm can differ from it in the last bits, and so,
    with a binding clip, the update. With several ranks, ``trace_path`` names rank 0's file;
    rank r writes ``<trace_path>.rank<r>``.
    """

    def __init__(self, policy: Optional[str] = None, *, log_metrics: bool = True,
                 allow_untested_framework: bool = False, framework_norm: bool = False,
                 **guard_options: Any) -> None:
        if not isinstance(framework_norm, bool):
            raise TypeError("stepguard: framework_norm must be a bool, got %s"
                            % type(framework_norm).__name__)
        self.framework_norm = framework_norm or is_off(guard_options)
        self.policy = policy
        self.log_metrics = log_metrics
        self.allow_untested_framework = allow_untested_framework
        self.guard_options = guard_options
        self.guards: List[_LightningGuard] = []
        self.incidents: List[Dict[str, Any]] = []
        self._records: Optional[List[Dict[str, Any]]] = None  # from a checkpoint, for on_fit_start
        self._patches = Patches()  # every attribute written on Lightning's objects, undone
        self._watches: List[Any] = []  # hooks refusing a step of an optimizer behind the guard
        self._origins: List[GradientWatch] = []  # hooks naming a fault's origin rank (DDP)
        self.last_report: Any = None  # the newest step's report (any optimizer's)
        self._engine: Any = None  # DeepSpeedStrategy: the guard in its engine
        self._engine_seen: Any = None  # the engine guard's report handled last
        self._engine_figures: Optional[Figures] = None

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        check_version("lightning", pl.__version__)
        check_seams("lightning", self.allow_untested_framework)
        self.detach()  # what a fit that raised left (Lightning runs no teardown then)
        engine = _deepspeed_engine(trainer)
        if engine is not None:
            # Refused now what cannot be guarded; the guard goes into the engine at train
            # start, after Lightning restored a checkpoint into it (DeepSpeedStrategy restores
            # after on_fit_start).
            check_version("deepspeed")
            check_config(trainer.strategy.config)
            _check_engine(engine)
            self._hold_schedulers(trainer, pl_module)
            return
        self._engine = None  # (a DeepSpeed fit before this one's: detached above)
        scaler = self._scaler(trainer)
        options = guard_options(self.guard_options, self.policy)
        layout = options.pop("layout", None)  # the port's (every optimizer's port is one)
        named = list(pl_module.named_parameters())  # the module's names, not DDP's "module."
        guards = []
        kept = {id(guard.optimizer): guard for guard in self.guards}  # a fit before this one's
        for optimizer in trainer.strategy.optimizers:
            if isinstance(optimizer, GuardedOptimizer) and not isinstance(optimizer,
                                                                          _LightningGuard):
                raise ValueError("stepguard: configure_optimizers returned a GuardedOptimizer; "
                                 "return the plain optimizer, StepguardCallback wraps it")
            if id(optimizer) in kept:
                optimizer = kept[id(optimizer)]
                self._watches.append(refuse_bypass(optimizer, "Lightning"))
            elif not isinstance(optimizer, _LightningGuard):
                optimizer = _LightningGuard(optimizer, named,
                                            port=TrainerPort(optimizer, named, scaler, layout),
                                            **with_sharding(options, optimizer))
                self._watches.append(refuse_bypass(optimizer, "Lightning"))
                optimizer.track_buffers(pl_module.named_buffers())
            guards.append(optimizer)
        self._origins = [GradientWatch().install(guard, [p for group in guard.param_groups
                                                         for p in group["params"]])
                         for guard in guards]
        # Lightning wraps each in a fresh LightningOptimizer (the property's setter).
        self._patches.set_property(trainer.strategy, "optimizers", guards)
        self.guards = guards
        if not trainer.strategy.restore_checkpoint_after_setup:
            self._take_records(trainer)  # else Lightning restores them after on_fit_start
        self._hold_schedulers(trainer, pl_module)
        self._verdict_before_clip(trainer)
        self._clip_from_verdict(trainer)
        if scaler is not None:
            self._step_what_the_scaler_skips(trainer)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Strategies that restore a checkpoint after setup (DeepSpeed, ModelParallel, FSDP)
        # hand this callback its saved state after on_fit_start and before this.
        engine = _deepspeed_engine(trainer)
        if engine is None:
            if trainer.strategy.restore_checkpoint_after_setup:
                self._take_records(trainer)
            return
        self._engine = guard_trainer_engine(engine, self._engine, self.policy, self.guard_options,
                                            "Lightning's DeepSpeedStrategy",
                                            framework_norm=self.framework_norm,
                                            allow_untested_framework=self.allow_untested_framework)
        guard = self._engine.guard
        self.guards = [guard]
        self._take_records(trainer)
        self._engine_seen = self._engine.last_report
        self._engine_figures = Figures(guard)

    def _take_records(self, trainer: "pl.Trainer") -> None:
        """The guards' state from the checkpoint the fit resumes from (this callback's saved
        state), or a warning that a checkpoint without it starts the guard afresh."""
        if self._records is not None:
            for guard, record in zip(self.guards, self._records):
                load_guard_state(guard, record, "this checkpoint")
                if isinstance(guard, _LightningGuard):
                    guard.figures = Figures(guard)  # its counts go on from the checkpoint's
            self._records = None
        elif trainer.ckpt_path is not None:  # Lightning gave this callback no state
            load_guard_state(self.guards[0], None, trainer.ckpt_path)

    def _scaler(self, trainer: "pl.Trainer") -> Any:
        """The precision plugin's GradScaler ('16-mixed'), or None. A plugin that keeps a
        scaler elsewhere than Lightning's MixedPrecision does is refused: its overflow steps
        would pass the guard by."""
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if scaler is None:
            return None
        if not isinstance(plugin, pl.plugins.precision.MixedPrecision):
            raise ValueError("stepguard: the precision plugin %s runs a GradScaler the "
                             "integration does not know; use MixedPrecision ('16-mixed'), "
                             "'bf16-mixed' or '32-true'" % type(plugin).__name__)
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError("stepguard: precision='16-mixed' with a %s; the integration "
                             "follows torch.amp.GradScaler" % type(scaler).__name__)
        check_seams("torch", self.allow_untested_framework)
        return scaler
    def _guard_of(self, optimizer: Any) -> Optional[_LightningGuard]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        for guard in self.guards:
            if optimizer is guard:
                return guard
        return None

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           loss: torch.Tensor) -> None:
        # The loss backward runs on (divided by accumulate_grad_batches): summed over the
        # micro-batches of a step, the step's mean loss.
        if not torch.is_tensor(loss) or loss.numel() != 1 or self._engine is not None:
            return  # (DeepSpeed: the engine's backward hands the guard the loss)
        # Under '16-mixed' Lightning hands over the loss its GradScaler scaled for backward.
        loss = scaled_loss_unscaled(loss, getattr(trainer.precision_plugin, "scaler", None))
        for guard in self.guards:
            guard.add_loss(loss)

    # The verdict is taken after the last point where Lightning lets user code change the
    # gradients: Precision._after_closure runs the callbacks' on_before_optimizer_step, then the
    # LightningModule's own (a user's clipping or noise there is judged), then the gradient
    # clip (_verdict_before_clip); a step that never passes there takes it in the guarded step.
    def _take_verdict(self, trainer: "pl.Trainer", guard: _LightningGuard) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if (scaler is not None and scaler.is_enabled()
                and trainer.lightning_module.automatic_optimization
                and not scaler_unscaled(scaler, guard)):
            return  # '16-mixed' and training_step returned None: no backward, no step
        guard.take_verdict()

    def _verdict_before_clip(self, trainer: "pl.Trainer") -> None:
        # Precision._after_closure ends with _clip_gradients, after the callbacks' and the
        # LightningModule's on_before_optimizer_step and (under '16-mixed') after the unscale,
        # before the GradScaler's step: the verdict there, then Lightning's own clipping.
        plugin = trainer.precision_plugin
        original = plugin._clip_gradients

        def _clip_gradients(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
            guard = self._guard_of(optimizer)
            if guard is not None and guard.pending is None:
                self._take_verdict(trainer, guard)
            original(model, optimizer, *args, **kwargs)

        self._patches.set(plugin, "_clip_gradients", _clip_gradients)

    def _clip_from_verdict(self, trainer: "pl.Trainer") -> None:
        # Lightning clips by norm through its precision plugin's clip_grad_by_norm (called from
        # LightningModule.clip_gradients, which configure_gradient_clipping calls); the instance
        # attribute in front of it hands the clip to the guarded step, which clips from the
        # guard's agreed norm, on applied steps only. Other optimizers clip as Lightning does.
        plugin = trainer.precision_plugin
        original = plugin.clip_grad_by_norm

        def clip_grad_by_norm(optimizer: Any, clip_val: Any) -> None:
            guard = self._guard_of(optimizer)
            if guard is not None and guard.pending is None:
                self._take_verdict(trainer, guard)
            if guard is None or guard.pending is None:  # (a batch a rollback drops)
                original(optimizer, clip_val)
            elif self.framework_norm:  # Lightning's own norm and clip, the policy's after it
                original(optimizer, clip_val)
                params = [p for g in guard.param_groups for p in g["params"]]
                policy_clip_after(params, float(clip_val), guard.pending)
                guard.clipped = True
            else:
                guard.max_norm = float(clip_val)

        self._patches.set(plugin, "clip_grad_by_norm", clip_grad_by_norm)

    def _step_what_the_scaler_skips(self, trainer: "pl.Trainer") -> None:
        # Under '16-mixed' the plugin's optimizer_step runs the closure, unscales, runs the
        # hooks and the clip (the verdict) and calls scaler.step(guard), which leaves the
        # guard's step out when this rank's gradients hold Inf or NaN, then scaler.update()
        # backs the scale off. The guard's decision on that step is carried out after it: a
        # skip, or the policy's rollback or abort. Growth and backoff stay the scaler's.
        plugin = trainer.precision_plugin
        original = plugin.optimizer_step

        def optimizer_step(optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
            guard = self._guard_of(optimizer)
            calls = guard.calls if guard is not None else 0
            out = original(optimizer, model=model, closure=closure, **kwargs)
            # A step with a backward (its loss recorded) that the scaler left out.
            if guard is not None and guard.calls == calls and (
                    guard.pending is not None or guard.dropping or guard.loss_given):
                # Manual optimization's opt.step() returns the step's report either way.
                return guard.step_the_scaler_skipped()
            return out

        self._patches.set(plugin, "optimizer_step", optimizer_step)

    def _hold_schedulers(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Lightning steps schedulers by calling the module's lr_scheduler_step hook (the user's
        # override included) after the optimizer step; an instance attribute in front of it lets
        # a step-interval scheduler move only when its optimizer's step was applied.
        original = pl_module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if not self._holds(trainer, scheduler):
                original(scheduler, metric)

        self._patches.set(pl_module, "lr_scheduler_step", lr_scheduler_step)

    def _holds(self, trainer: "pl.Trainer", scheduler: Any) -> bool:
        configs = [c for c in trainer.lr_scheduler_configs if c.scheduler is scheduler]
        if configs and configs[0].interval != "step":
            return False  # epoch schedulers count epochs, not steps
        target = getattr(scheduler, "optimizer", None)
        if self._engine is not None and target is self._engine.guard.optimizer:
            report = self._engine.last_report  # DeepSpeed: the engine's optimizer's step
            return report is not None and not report.applied
        for guard in self.guards:
            if target is guard or target is guard.optimizer:
                return guard.held_back
        return False

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._engine is not None:  # DeepSpeed: a new report when the engine stepped
            report = self._engine.last_report
            if report is not None and report is not self._engine_seen:
                self._engine_seen = report
                self._engine_figures.update(report)
                self._after_step(trainer, pl_module, report, self._engine_figures, "stepguard/")
            return
        for i, guard in enumerate(self.guards):
            if not guard.fresh:
                continue  # accumulating gradients: no step this batch
            guard.fresh = False
            prefix = "stepguard/" if len(self.guards) == 1 else "stepguard/%d/" % i
            self._after_step(trainer, pl_module, guard.last_report, guard.figures, prefix)

    def _after_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", report: Any,
                    figures: Figures, prefix: str) -> None:
        self.last_report = report
        if report is not None and report.incident is not None:
            self._incident(trainer, report)
        if report is not None and report.aborted:
            log.error("stepguard: step %d aborted training: %s", report.step,
                      (report.incident or {}).get("reason", ""))
            trainer.should_stop = True
        if self.log_metrics:
            # From the reports: stats() would wait for the snapshot copy the step began. One
            # host tensor for the figures: Lightning makes a device tensor of each number it is
            # given (a copy to the device per value per step), a host tensor it keeps as it is.
            metrics = figures.step_figures()
            values = torch.tensor([float(v) for v in metrics.values()],
                                  dtype=torch.get_default_dtype())
            pl_module.log_dict({prefix + k: v for k, v in zip(metrics, values)},
                               on_step=True, on_epoch=False, batch_size=1)

    def _incident(self, trainer: "pl.Trainer", report: Any) -> None:
        # The guard's logger says it once for the job (rank 0): stepguard._log.
        self.incidents.append(dict(report.incident))

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                 stage: str) -> None:
        self.detach()

    def detach(self) -> "StepguardCallback":
        """Undoes what ``on_fit_start`` set (Lightning calls it at teardown; the next fit's
        start calls it after a fit that raised): the strategy's optimizers are the plain ones
        again, the instance attributes in front of the precision plugin's clip and
        optimizer_step and of the module's lr_scheduler_step are gone, the hooks on the wrapped
        optimizers removed. ``guards`` keep their state: the next fit with this callback goes
        on with them. Returns the callback."""
        for handle in self._watches + self._origins:
            handle.remove()
        self._watches, self._origins = [], []
        if self._engine is not None:
            self._engine.detach()
        self._patches.restore()
        return self

    # The guard's decision state (detector statistics, LR factor, loss scale, counts) rides in
    # the checkpoint as this callback's state; the optimizer state stays plain.
    def state_dict(self) -> Dict[str, Any]:
        return {"records": [guard.guard_state_dict() for guard in self.guards]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._records = list(state_dict.get("records", [])) or None


def _deepspeed_engine(trainer: "pl.Trainer") -> Any:
    """The DeepSpeed engine of a fit under ``DeepSpeedStrategy`` (set up before on_fit_start),
    or None."""
    if not isinstance(trainer.strategy, pl.strategies.DeepSpeedStrategy):
        return None
    return trainer.strategy.model

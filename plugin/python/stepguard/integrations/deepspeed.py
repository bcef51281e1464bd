"""stepguard inside DeepSpeed: guards the step of the optimizer the engine actually runs.

After ``deepspeed.initialize`` add one line; the training loop stays as it is::

    engine, _, _, scheduler = deepspeed.initialize(model=model, config=ds_config, ...)
    sg = stepguard.integrations.deepspeed.guard_engine(engine, policy="run.yaml")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)      # records the loss for the guard (mean over micro-batches)
        engine.step()              # the guard decides inside the engine's optimizer step
        report = sg.last_report    # the newest optimizer step's (DeepSpeed steps at the
                                   # gradient-accumulation boundary; the loss is the mean of
                                   # the micro-batches' losses since the last one)

What is guarded, by DeepSpeed optimizer (tested with DeepSpeed 0.19.8 on CPU/Gloo):

- fp32 without ZeRO: the client or config optimizer itself (the model's parameters);
- bf16 without ZeRO: ``FP16_UnfusedOptimizer`` (a client or ``torch_adam`` optimizer) and
  ``FP16_Optimizer`` (the config's AdamW, DeepSpeed's FusedAdam): their fp32 master copies
  (the flat masters' pieces, one per model parameter), inspected on the bf16 gradients
  DeepSpeed averaged;
- ZeRO stages 1 and 2, fp32 or bf16 (``DeepSpeedZeroOptimizer``): this rank's partition of the
  fp32 master weights and of the averaged gradients, one view per parameter piece (blame names
  the model's parameters); norms and counts are summed over the data-parallel ranks;
- bf16 with fp32 gradient accumulation (``BF16_Optimizer``, ``"data_types": {"grad_accum_dtype":
  "fp32"}``): the same, over its fp32 master partitions and its averaged fp32 gradient buffers;
- DeepSpeed's Muon (``"optimizer": {"type": "Muon"}``, MuonWithAuxAdam) in each of these layouts
  and ZeRO 3: DeepSpeed's own step orthogonalises the update (under ZeRO 3 inside its step,
  after the verdict on the raw gradients, so DeepSpeed clips with its own norm there).

The guard decides before DeepSpeed's own step: an applied step is DeepSpeed's own ``step()``
(its clipping, its copy of the master weights into the model; no DeepSpeed step body is
re-implemented); a step the guard does not apply takes DeepSpeed's own overflow path, so
``engine.skipped_steps`` counts it and the engine does not step its LR scheduler. The norm
DeepSpeed clips with and reports: under ZeRO 1, 2 and 3 and fp32 without ZeRO the agreed norm
(fp64, reduced once with the verdict: no second read of the gradients and all-reduce), which
differs from DeepSpeed's own fp32 norm in the last bits, so with a binding clip an applied step
can differ from the unguarded one in the last bits; ``framework_norm=True`` has DeepSpeed
compute its own (one more read and all-reduce per step, as without the guard) and an applied
step is then bitwise DeepSpeed's own. bf16 without ZeRO and ``BF16_Optimizer`` always pay
DeepSpeed's own norm (handing the agreed one in would need a copy of their step). A rollback restores the fp32 master weights and the
optimizer state (each rank its own partition) and copies them into the model's bf16 weights
(ZeRO: DeepSpeed's ``update_lp_params``, an all-gather every rank makes together). The guard's
LR factor scales the optimizer's groups for the step. fp16 under ZeRO 1 and 2: DeepSpeed's
DynamicLossScaler owns the scale; the guard inspects the scaled gradients unscaled, an overflow
while the scale can back off is the `overflow` signal (skipped by DeepSpeed's own overflow path,
the scale backing off by DeepSpeed's rules, hysteresis included), the reports carry DeepSpeed's
scale; at DeepSpeed's ``min_loss_scale`` the policy decides instead of DeepSpeed's "Current loss
scale already at minimum" exit (``limits.loss_scale_floor`` counts the steps there). A policy's
``loss_scale`` section (the ``deepspeed-fp16`` preset's) is taken as DeepSpeed's scaler's and
turns nothing of the guard's on; ``loss_scaling=True`` is refused. ZeRO 3 (fp32, bf16, fp16):
each rank's partition of every parameter in the flat fp32 masters of each sub-group, read at one
piece per parameter (the partition padding left out) with the step's averaged gradients; a
rollback puts the masters back into the partitioned lp parameters as DeepSpeed's checkpoint
load does. ZeRO 1, 2 and 3 with ``offload_optimizer`` to the CPU (ZeRO-Offload): the guard
reads the host copies the optimizer steps (each rank's fp32 partition and its averaged gradients
in the host buffer beside it) and restores them. Refused, with a message: fp16 without ZeRO,
offload to NVMe, parameter offload, partial optimizer offload, and pipeline engines (``check_config``
tells what a config alone shows, before the engine exists). What the integration replaces,
writes or calls privately is declared (``_seams_deepspeed.py``, docs/frameworks.md) and the
DeepSpeed functions it relies on are fingerprinted: a release whose functions changed is
refused at ``guard_engine`` naming them (``allow_untested_framework=True``: a warning).
``EngineGuard.detach()`` gives the engine back its own methods; the HF Trainer's and Lightning's
DeepSpeed paths use this integration.
"""

import warnings

import torch

from .._guard import GuardedOptimizer
from .._port import TorchOptimPort
from ._core import (LOOP, OUT_OF_REACH, STATE_KEY, FrameworkGuard, GradientWatch, check_version,
                    finish_step, guard_options, is_off, load_guard_state)
from ._deepspeed_layouts import (_Bf16Layout, _FusedLayout, _PlainLayout, _UnfusedLayout,
                                 _Zero3Layout, _ZeroLayout)
from ._seams import Patches, check_seams


def guard_engine(engine, *, policy=None, policy_yaml=None, process_group=None,
                 framework_norm=False, allow_untested_framework=False, **options):
    """Guards ``engine``'s optimizer step; returns the ``EngineGuard`` (``.guard`` is the
    ``GuardedOptimizer``; ``.last_report`` the newest step's report). ``process_group`` defaults
    to every rank of the job (WORLD) when it runs several. ``framework_norm``: DeepSpeed clips
    with its own norm (an applied step bitwise DeepSpeed's own; one more norm and all-reduce
    per step) instead of the agreed one. ``allow_untested_framework``: run on a DeepSpeed whose
    relied-on functions changed, with a warning. Other keywords are ``GuardedOptimizer``'s
    options (one ``trace_path`` becomes ``<path>.rank<r>`` on rank r)."""
    return EngineGuard(engine, policy=policy, policy_yaml=policy_yaml,
                       process_group=process_group, framework_norm=framework_norm,
                       allow_untested_framework=allow_untested_framework, **options)


class EngineGuard:
    """The guard installed in a DeepSpeed engine (see the module's docstring)."""

    _reduction = "mean"  # engine.backward(loss) gets each micro-batch's own loss
    _drops = LOOP

    def __init__(self, engine, *, policy=None, policy_yaml=None, process_group=None,
                 framework_norm=False, allow_untested_framework=False, **options):
        import deepspeed
        check_version("deepspeed", deepspeed.__version__)
        _check_engine(engine)
        if not isinstance(framework_norm, bool):
            raise TypeError("stepguard: framework_norm must be a bool, got %s"
                            % type(framework_norm).__name__)
        check_seams("deepspeed", allow_untested_framework)
        self.engine = engine
        ds_optimizer = engine.optimizer
        layout = _layout_of(engine, ds_optimizer)
        # ZeRO 3 (and ZeRO-Offload) with Muon: DeepSpeed orthogonalises the gradients inside
        # its step, before its norm; the clip must take that norm, not the agreed one of the raw
        # gradients.
        layout.framework_norm = framework_norm or is_off(options) or (_uses_muon(engine) and (
            isinstance(layout, _Zero3Layout) or getattr(layout, "offload", False)))
        # Every rank of the job takes each step's decision together (model-parallel peers too):
        # WORLD over several ranks unless given; one trace file per rank.
        if process_group is not None:
            options["process_group"] = process_group
        options = guard_options(options)
        if "sharded_gradients" in options and options["sharded_gradients"] != layout.sharded:
            raise ValueError("stepguard: sharded_gradients=%r does not match this engine (ZeRO "
                             "stage %d): leave it out" % (options["sharded_gradients"],
                                                          engine.zero_optimization_stage()))
        options["sharded_gradients"] = layout.sharded
        self._ds_step = ds_optimizer.step  # the bound method DeepSpeed defines
        port = _DeepSpeedPort(engine.basic_optimizer, layout, self._ds_step)
        self.guard = GuardedOptimizer(engine.basic_optimizer, port=port, policy=policy,
                                      policy_yaml=policy_yaml, **options)
        self._layout = layout
        # The step's loss (each micro-batch's as engine.backward gets it: their mean), the
        # newest report, the batches a rollback drops (the loop's iterator: drop_batches).
        self.core = FrameworkGuard("DeepSpeed", self._reduction, self._drops)
        self._expected = None  # (global_steps, skipped_steps) once DeepSpeed ends the last step
        self._ds_backward, self._ds_scale = engine.backward, engine.scale
        # Instance attributes over the engine's and its optimizer's methods: the engine calls
        # these names (engine._take_model_step: self.optimizer.step(), then .overflow), and
        # nothing else of DeepSpeed changes. backward() and scale() (DeepSpeed's manual path,
        # engine.scale(loss).backward()) hand the guard the loss. detach() takes them out.
        self._patches = Patches()
        self._watch = GradientWatch()  # the hooks that name the origin rank (several ranks)
        self.attach()

    def attach(self):
        """Puts the guard (back) into the engine; ``guard_engine`` does it. Returns self."""
        if vars(self.engine).get("backward") != self._backward:
            self._patches.set(self.engine, "backward", self._backward)
            self._patches.set(self.engine, "scale", self._scale)
            self._patches.set(self.engine.optimizer, "step", self._step)
            self._layout.install(self._patches)
            self._watch.install(self.guard, self.engine.module.parameters())
        return self

    def detach(self):
        """Takes the guard out of the engine: its ``backward``, ``scale``, its optimizer's
        ``step`` and what the layout wrote (without ZeRO: the engine's own fp32 clip) are
        DeepSpeed's again (the engine steps unguarded). ``guard`` keeps its state, and
        ``attach()`` puts it back."""
        self._layout.applied()  # the overflow flag the layout set back to what attach wrote
        self._patches.restore()
        self._watch.remove()
        self.core.loss.clear()
        self._expected = None

    def record_loss(self, loss):
        """This micro-batch's loss, for a loop that calls ``loss.backward()`` itself instead of
        ``engine.backward(loss)``."""
        self.core.loss.add(loss)

    @property
    def last_report(self):
        """The newest optimizer step's report (None before the first)."""
        return self.core.last_report

    def drop_batches(self, iterator, micro_batches=None):
        """Draws from ``iterator`` the batches the last rollback drops (the policy's
        ``skip_batches``), for a loop that owns its data iterator: call it before each step's
        first micro-batch. Each batch is ``micro_batches`` items of the iterator (default: the
        engine's gradient accumulation steps, as DeepSpeed's loop draws one micro-batch per
        ``engine.backward``). Returns how many batches were dropped (0 on most steps)."""
        if micro_batches is None:
            micro_batches = self.engine.gradient_accumulation_steps()
        return self.core.batches.draw(iterator, micro_batches)

    def state_dict(self):
        """The guard's decision state, for DeepSpeed's checkpoint:
        ``engine.save_checkpoint(dir, client_state=sg.state_dict())``; DeepSpeed saves the
        optimizer state itself."""
        return {STATE_KEY: self.guard.guard_state_dict()}

    def load_state_dict(self, client_state):
        """After ``_, client_state = engine.load_checkpoint(dir)``. A client state without the
        guard's entry (saved without ``client_state=sg.state_dict()``, or None where DeepSpeed
        found no checkpoint): the guard starts fresh, with a warning."""
        if client_state is not None and not isinstance(client_state, dict):
            raise TypeError("stepguard: load_state_dict takes the client state dict "
                            "engine.load_checkpoint returned, got %s" % type(client_state).__name__)
        load_guard_state(self.guard, (client_state or {}).get(STATE_KEY),
                         "this DeepSpeed client state")

    def _backward(self, loss, *args, **kwargs):
        self.record_loss(loss)
        return self._ds_backward(loss, *args, **kwargs)

    def _scale(self, loss):
        self.record_loss(loss)
        return self._ds_scale(loss)

    def _step(self, closure=None):
        self._check_last_step()
        loss = self.core.loss.take()
        # The verdict first (the step's one collective); an applied step is DeepSpeed's update
        # with the agreed norm as its norm (no second norm, no second all-reduce).
        verdict = self.guard.verdict(loss)
        self._layout.verdict = verdict
        try:
            report = finish_step(self.guard, verdict)
        finally:
            self._layout.verdict = None
        self.core.finished(report)
        if not report.applied:
            self._layout.skip(self._ds_step)
            if not getattr(self.engine.optimizer, "overflow", False):
                raise RuntimeError(
                    "stepguard: DeepSpeed applied step %d, which the guard did not apply (%s): "
                    "its overflow path did not run as in the release the integration was "
                    "tested with (0.19.8); stop and check the run" % (report.step, report.outcome))
        else:
            self._layout.applied()
        # DeepSpeed counts a step its optimizer reported as overflowed (engine.skipped_steps)
        # after this call returns; the next step checks that it did as the guard decided.
        # (engine._take_model_step: overflow -> skipped_steps += 1, then global_steps += 1).
        self._expected = (self.engine.global_steps + 1,
                          self.engine.skipped_steps + (0 if report.applied else 1))
        return report

    def _check_last_step(self):
        expected, self._expected = self._expected, None
        # Another global step count: a checkpoint was loaded in between; nothing to compare.
        if expected is None or self.engine.global_steps != expected[0]:
            return
        expected, skipped, last = expected[1], self.engine.skipped_steps, self.last_report
        if skipped == expected:
            return
        if skipped > expected:
            # DeepSpeed's own overflow check skipped a step the guard applied: nothing was
            # applied that the guard refused, but the guard's counts call the step applied.
            warnings.warn(
                "stepguard: DeepSpeed skipped step %d itself (its skipped_steps is %d, the guard "
                "expected %d): the guard's report and counts call that step applied"
                % (last.step, skipped, expected), RuntimeWarning)
            return
        raise RuntimeError(
            "stepguard: DeepSpeed did not take the guard's decision of step %d (%s): its "
            "skipped_steps is %d, the guard expected %d. This DeepSpeed release steps otherwise "
            "than the integration was tested with (0.19.8): a step the guard skipped may have "
            "been applied; stop and check the run" % (last.step, last.outcome,
                                                      skipped, expected))


_FP16_WITHOUT_ZERO = ("fp16 without ZeRO (DeepSpeed 0.19.8's fp16 wrappers without ZeRO do not "
                      "apply the loss scale in engine.backward() while their step divides by "
                      "it; upstream PR #8393); use ZeRO 1, 2 or 3, bf16 or fp32")
_OFFLOAD = ("offload to NVMe, or of the parameters (its optimizer steps copies the guard does "
            "not read); offload_optimizer to the CPU is guarded (ZeRO 1, 2 and 3)")


def check_config(config):
    """Refuses, before ``deepspeed.initialize``, what the DeepSpeed ``config`` (a dict) alone
    shows the integration cannot guard (values still ``"auto"`` are left to ``guard_engine``,
    which checks the engine)."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    fp16 = (config.get("fp16") or {}).get("enabled", False)
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    params = (zero.get("offload_param") or {}).get("device", "none")
    refuse = None
    if fp16 is True and stage == 0:
        refuse = _FP16_WITHOUT_ZERO
    elif offload == "nvme" or params in ("cpu", "nvme"):
        refuse = _OFFLOAD
    if refuse:
        raise ValueError("stepguard: the DeepSpeed integration does not guard " + refuse)


class _TrainerEngineGuard(EngineGuard):
    """The guard in the engine of a Trainer (HF's, Lightning's DeepSpeedStrategy): the Trainer
    hands the engine each micro-batch's loss already divided by the accumulation steps, so the
    step's loss is their sum, the loss the Trainer logs. The Trainer's data order is out of the
    guard's reach (the batches a rollback drops are trained on, said once)."""

    _reduction = "sum"
    _drops = OUT_OF_REACH


def guard_trainer_engine(engine, previous, policy, options, framework, framework_norm=False,
                         allow_untested_framework=False):
    """The guard in a Trainer's engine: ``previous`` (an earlier fit's) put back when it guards
    this engine, else a new one that goes on with ``previous``'s state."""
    if previous is not None and previous.engine is engine:
        return previous.attach()
    options = dict(options)
    options.pop("layout", None)  # the engine's own
    guard = _TrainerEngineGuard(engine, policy=policy, framework_norm=framework_norm,
                                allow_untested_framework=allow_untested_framework, **options)
    guard.core.batches.framework = framework
    if previous is not None:
        previous.detach()
        guard.guard.load_guard_state_dict(previous.guard.guard_state_dict())
    return guard


def _check_engine(engine):
    refuse = None
    if getattr(engine, "optimizer", None) is None:
        refuse = "an engine without an optimizer (deepspeed.initialize got none)"
    elif engine.fp16_enabled() and engine.zero_optimization_stage() == 0:
        refuse = _FP16_WITHOUT_ZERO
    elif engine.zero_optimization() and (
            engine.zero_nvme_offload_optimizer() or
            getattr(engine.zero_offload_param(), "device", "none") != "none"):
        refuse = _OFFLOAD
    elif engine.zero_cpu_offload() and engine.zero_partial_offload() != 1.0:
        refuse = ("partial optimizer offload (offload_optimizer.ratio %s: some sub-groups step "
                  "on the host, some on the device)" % engine.zero_partial_offload())
    elif type(engine).__name__ == "PipelineEngine":
        refuse = "pipeline parallelism (PipelineEngine)"
    elif getattr(engine, "has_moe_layers", False):
        refuse = ("mixture-of-experts layers (DeepSpeed's norm counts each rank's experts once "
                  "and the dense parameters across ranks; the guard's layout would count every "
                  "expert as a replica, and a binding clip would clip wrongly)")
    if refuse:
        raise ValueError("stepguard: the DeepSpeed integration does not guard " + refuse)


def _uses_muon(engine):
    """Whether the engine steps DeepSpeed's Muon (MuonWithAuxAdam: Muon on the parameters marked
    ``use_muon``, Adam on the rest)."""
    return type(engine.basic_optimizer).__name__ == "MuonWithAuxAdam"


def _layout_of(engine, ds_optimizer):
    kind = type(ds_optimizer).__name__
    if ds_optimizer is engine.basic_optimizer:
        return _PlainLayout(engine)
    if kind == "FP16_UnfusedOptimizer":
        return _UnfusedLayout(engine, ds_optimizer)
    if kind == "FP16_Optimizer":
        return _FusedLayout(engine, ds_optimizer)
    if kind == "BF16_Optimizer":
        return _Bf16Layout(engine, ds_optimizer)
    if kind == "DeepSpeedZeroOptimizer":
        return _ZeroLayout(engine, ds_optimizer)
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        return _Zero3Layout(engine, ds_optimizer)
    raise ValueError(
        "stepguard: the DeepSpeed engine steps a %s, which the integration does not know (it "
        "guards a torch optimizer without ZeRO, bf16 without ZeRO (the config's or a client "
        "optimizer), ZeRO stages 1 and 2, and BF16_Optimizer)" % kind)


class _DeepSpeedPort(TorchOptimPort):
    """The torch.optim port over DeepSpeed's basic optimizer: its state (keyed by the flat fp32
    tensors it steps) is what snapshots hold; the parameters and gradients the engine inspects
    and restores are the layout's per-parameter views."""

    def __init__(self, basic_optimizer, layout, ds_step):
        super().__init__(basic_optimizer)
        self.partition = layout
        self.ds_step = ds_step
        if isinstance(layout, _PlainLayout):
            self.gradients = None  # the model's parameters: the engine reads .grad itself

    def parameters(self):
        keys = getattr(self.partition, "state_keys", None)
        if keys is not None:  # ZeRO 3: the flat masters, outside the optimizer's param groups
            self._params = keys()
            self._names = ["subgroup%d" % i for i in range(len(self._params))]
        else:
            self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
            self._names = ["group%d.tensor%d" % (i, j)
                           for i, g in enumerate(self.optimizer.param_groups)
                           for j in range(len(g["params"]))]
        return self.partition.parameters()

    def gradients(self):
        return self.partition.gradients()

    def framework_loss_scale(self):
        """DeepSpeed's loss scale and its floor under fp16 (its scaler owns them; a static scale
        cannot back off: its floor is itself), None otherwise."""
        return self.partition.framework_loss_scale()

    def sharded_state(self):
        return self.partition.sharded

    def update(self):
        self.partition.update(self.ds_step)

    def after_restore(self):
        self.partition.refresh_model()

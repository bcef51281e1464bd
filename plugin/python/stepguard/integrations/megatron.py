"""stepguard inside Megatron-core: a guarded optimizer that stands where Megatron's optimizer
stands, in every parallel layout (data, tensor and pipeline parallel, the distributed optimizer).

Wrap what ``get_megatron_optimizer`` returns; Megatron's training loop is unchanged::

    optimizer = get_megatron_optimizer(optimizer_config, model_chunks)
    optimizer = stepguard.integrations.megatron.GuardedMegatronOptimizer(
        optimizer, model_chunks, policy="run.yaml")
    config.grad_scale_func = optimizer.scale_loss   # Megatron-LM's training.py does this itself
    ...
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    optimizer.drop_batches(data_iterator, num_microbatches)  # a rollback's dropped batches

``step()`` runs Megatron's own stages with the guard's two phases between them: ``prepare_grads()``
(model gradients into the fp32 main gradients; each rank's shard under the distributed optimizer),
the guard's ``verdict()`` on those main gradients (its one collective, over every rank of the job),
then on an applied step Megatron's clip given the agreed norm
(``clip_grad_by_total_norm_fp32(total_norm=...)``: the norm is computed once per step, and not at
all beyond the guard's when ``clip_grad == 0``; ``framework_norm=True``: Megatron's own norm for
its clip, one more norm and all-reduce per step, and a clean step bitwise Megatron's own),
Megatron's zero count and ``step_with_ready_grads()``, and the guard's ``settle()``. It returns
Megatron's ``(update_successful, grad_norm, num_zeros_in_grad)`` with the agreed norm on an applied
step, ``(False, None, None)`` on a step the guard did not apply (the training loop then counts a
skipped iteration and does not step its LR scheduler). A rollback restores the fp32 main parameters
and the optimizer state (each rank its shard under the distributed optimizer) and copies them into
the model's parameters, as Megatron's step does.

The parallel layout comes from Megatron's own marks: a parameter with ``tensor_model_parallel``
is a shard over the tensor-parallel group, any other is a copy on every tensor-parallel rank
(layernorms, row-parallel biases, position embeddings); the word embedding and the last stage's
output weight are one tied gradient under pipeline parallelism (``shared_embedding``); the
data-parallel replicas hold the same gradient unless the distributed optimizer shards it. Every
element of the job is counted once, as Megatron's ``get_grad_norm`` counts it, and each pipeline
stage inspects its own parameters.

Checkpoints: ``state_dict()``/``load_state_dict()`` (the per-rank ``torch.save`` format) and
``sharded_state_dict()`` (``dist_checkpointing``, Megatron-LM's default) carry the guard's state
under the key ``"stepguard"`` beside Megatron's; a checkpoint without it loads with a warning that
the guard starts fresh. ``grad_scale_func`` records each micro-batch's loss (see ``scale_loss``;
under pipeline parallelism the last stage's). Tested with megatron-core 0.16.1 (Python 3.11) and
0.19.2 (Python 3.12 and later; ``TESTED_VERSIONS``): an older release is refused at attach, a newer
one warned about. fp32 (``FP32Optimizer``), bf16 and fp16 (``Float16OptimizerWithFloat16Params``)
and the distributed optimizer, one optimizer (a ``ChainedOptimizer`` of one; the interleaved
schedule's model chunks share one: their parameters are named ``model0.``, ``model1.``, ... in
reports), and mixture of experts: a ``ChainedOptimizer`` of the dense and the expert parameters'
optimizers is guarded as one step with one norm, as Megatron steps it (an expert's parameters,
``allreduce`` False, are held by their expert-parallel rank and replicated over the expert
data-parallel ranks; the names in reports are each rank's local expert names). fp16: Megatron's
grad scaler owns the loss scale. ``prepare_grads()`` unscales the main gradients and updates the
scaler (backoff with its hysteresis, growth) as without the guard; the guard judges them with the
scale of the step's backward (the report's ``loss_scale``), an overflow is skipped as Megatron
skips it, and what the scale cannot fix (a NaN loss, the scale at ``min_loss_scale``) goes by the
policy. Refused with a message: multi-token-prediction models (not run with the guard), parameters
in one of Megatron 0.19's separate grad-norm groups, Megatron-FSDP, and fp16 with a chain of
several optimizers (each has its own grad scaler). What the guarded step relies on beyond
Megatron's public stages is declared in ``_seams_megatron.py`` and fingerprinted: a release whose
code there changed is refused, naming it (``allow_untested_framework=True``: a warning). """

import math

import torch

from .. import _C
from .._guard import GuardedOptimizer
from .._port import TorchOptimPort, check_name
from ._core import (LOOP, STATE_KEY, TESTED, FrameworkGuard, GradientWatch, check_version,
                    finish_step, guard_options, is_off, load_guard_state)
from ._chain import ChainedTorchOptimizer
from ._seams import check_seams


# The oldest and the newest megatron-core release the framework tests ran: the public stages
# used here (prepare_grads, step_with_ready_grads, ChainedOptimizer, get_forward_backward_func)
# are in both.
TESTED_VERSIONS = TESTED["megatron-core"]


def check_megatron_version(version=None):
    """``check_version`` of megatron-core: the installed one when ``version`` is left out
    (``__shortversion__``: megatron-core 0.19 appends "+<git hash>" to ``__version__`` when it
    is installed inside a git checkout)."""
    if version is None:
        import megatron.core
        version = getattr(megatron.core, "__shortversion__",
                          getattr(megatron.core, "__version__", "unknown"))
    check_version("megatron-core", version)


class GuardedMegatronOptimizer:
    """A guarded Megatron optimizer (see the module's docstring). Attributes it does not define
    are the wrapped optimizer's, so Megatron's training and checkpointing code take it as is."""

    def __init__(self, megatron_optimizer, model=None, *, policy=None, policy_yaml=None,
                 process_group=None, framework_norm=False, allow_untested_framework=False,
                 **options):
        """``model``: the model chunk (or list of chunks) the optimizer was built for, which
        names the parameters in reports; the optimizer's own ``model_chunks`` when left out.
        ``framework_norm``: Megatron computes its own norm for its clip (``get_grad_norm()``,
        one more norm and all-reduce per step, as without the guard), so a clean step is
        bitwise Megatron's own; default: Megatron clips with the guard's agreed norm (computed
        once; it can differ from Megatron's fp32 norm in the last bits).
        ``allow_untested_framework``: run on a Megatron whose functions the guarded step relies
        on (``_seams_megatron``) changed since the tested releases, with a warning (refused
        otherwise, naming them)."""
        if not isinstance(framework_norm, bool):
            raise TypeError("stepguard: framework_norm must be a bool, got %s"
                            % type(framework_norm).__name__)
        check_megatron_version()
        check_seams("megatron", allow_untested_framework)
        chunks = getattr(megatron_optimizer, "model_chunks", None) if model is None else model
        if chunks is None or (isinstance(chunks, (list, tuple)) and not chunks):
            raise TypeError("stepguard: this %s does not know its model: pass the model chunks "
                            "it was built for (GuardedMegatronOptimizer(optimizer, model))"
                            % type(megatron_optimizer).__name__)
        chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        # From the configs first: every rank refuses alike (a chain's length is per rank).
        _refuse_unguarded(megatron_optimizer, chunks)
        inners = _inner_optimizers(megatron_optimizer)
        inner = inners[0]
        self._megatron = megatron_optimizer
        self._inner = inner  # the first (the dense parameters' under MoE)
        self._inners = inners
        # Every rank of the job takes each step's decision together (WORLD over several ranks
        # unless given: Megatron's grad-stats group is the model-parallel one, which leaves out
        # the data-parallel replicas); one trace file per rank.
        if process_group is not None:
            options["process_group"] = process_group
        options = guard_options(options)
        process_group = options.pop("process_group", None)
        if "sharded_gradients" in options:
            raise ValueError("stepguard: sharded_gradients is not an option here: the Megatron "
                             "integration reads how every parameter is held (tensor, pipeline "
                             "and data parallel, the distributed optimizer) from Megatron")
        self._port = _MegatronPort(megatron_optimizer, inners, chunks, process_group)
        self._port.framework_norm = framework_norm or is_off(options)
        self.guard = GuardedOptimizer(self._port.optimizer, port=self._port, policy=policy,
                                      policy_yaml=policy_yaml, process_group=process_group,
                                      **options)
        # A NaN/Inf made in one rank's backward names it, not every rank the reduction reached.
        self._watch = GradientWatch().install(self.guard,
                                              [p for c in chunks for p in c.parameters()])
        # The step's loss (each micro-batch's divided by their count: their sum), the newest
        # report, the batches a rollback drops (the loop's data iterator: drop_batches).
        self.core = FrameworkGuard("Megatron", "sum", LOOP)

    def __getattr__(self, name):  # everything else is Megatron's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._megatron, name)

    def scale_loss(self, loss):
        """Megatron's ``grad_scale_func``: records the micro-batch's loss for the guard (Megatron
        divided it by the micro-batch count: the step's loss is their sum) and scales it as
        Megatron's optimizer does. Megatron also calls it on ``torch.ones(1)`` for the scale of
        MoE's auxiliary loss: only a loss that requires grad is the step's."""
        if loss.requires_grad:
            self.core.loss.add(loss)
        return self._megatron.scale_loss(loss)

    def record_loss(self, loss):
        """The step's loss, for a loop that does not pass ``scale_loss`` as grad_scale_func."""
        self.core.loss.clear()
        self.core.loss.add(loss)

    last_report = property(lambda self: self.core.last_report, doc="The newest step's report.")

    def drop_batches(self, data_iterator, micro_batches=1):
        """Draws from ``data_iterator`` the batches the last rollback drops (``skip_batches``),
        ``micro_batches`` items each, before the next step; returns their count (mostly 0)."""
        return self.core.batches.draw(data_iterator, micro_batches)

    @torch.no_grad()
    def step(self):
        port = self._port
        # fp16: the scale this step's backward used, read before prepare_grads() unscales the
        # main gradients by it and Megatron's grad scaler backs it off (an overflow) or grows it.
        port.scale = _scale_of(getattr(self._inner, "grad_scaler", None))
        found_inf = self._megatron.prepare_grads()
        if found_inf and port.scale is None:  # only a grad scaler finds inf
            raise RuntimeError("stepguard: Megatron's prepare_grads() found inf without a scaler")
        loss = self.core.loss.take()
        port.result = None
        port.verdict = verdict = self.guard.verdict(loss)

        def update():  # Megatron's clip from the agreed norm, its zero count and update
            if found_inf:
                # The guard counts every gradient Megatron checks: it cannot have applied a
                # step Megatron found Inf or NaN in on this rank.
                raise RuntimeError("stepguard: step %d: Megatron's grad scaler found Inf or NaN "
                                   "that the guard did not" % verdict.step)
            port.apply(verdict.lr_factor)
            return port.result[0]

        try:
            report = finish_step(self.guard, verdict, update=update)
        finally:
            port.verdict = None
        self.core.finished(report)
        if not report.applied:
            return False, None, None
        return self._port.result

    def zero_grad(self, set_to_none=True):
        self._megatron.zero_grad(set_to_none)

    def state_dict(self):
        """The per-rank format: Megatron's under "optimizer", the guard's under "stepguard"."""
        return {"optimizer": self._megatron.state_dict(), STATE_KEY: self.guard.guard_state_dict()}

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, **kwargs):
        """Megatron's ``sharded_state_dict`` with the guard's state under "stepguard", the same
        on every rank: it travels in the checkpoint's common part."""
        sharded = self._megatron.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        sharded[STATE_KEY] = {"format": _SHARDED_FORMAT,
                                 "record": self.guard.guard_state_dict()}
        return sharded

    def load_state_dict(self, state_dict):
        """Loads either format (``state_dict()``'s, or what ``dist_checkpointing.load`` gave back
        for ``sharded_state_dict()``). Without the guard's entry (a checkpoint saved unguarded):
        Megatron's part loads and the guard starts fresh, with a warning."""
        if not isinstance(state_dict, dict):
            raise TypeError("stepguard: load_state_dict takes a dict, got %s"
                            % type(state_dict).__name__)
        entry = state_dict.get(STATE_KEY)
        if entry is None:
            load_guard_state(self.guard, None, "this optimizer state dict")
            with torch.no_grad():  # Megatron writes into leaf main parameters in place
                self._megatron.load_state_dict(state_dict)
            return
        if isinstance(entry, dict) and entry.get("format") == _SHARDED_FORMAT:
            if set(entry) != {"format", "record"}:
                raise ValueError("stepguard: the state dict's 'stepguard' entry has the keys %s, "
                                 "not 'format' and 'record'" % sorted(entry))
            record = entry["record"]
            megatron_part = {k: v for k, v in state_dict.items() if k != STATE_KEY}
        elif set(state_dict) == {"optimizer", STATE_KEY}:
            record, megatron_part = entry, state_dict["optimizer"]
        else:
            raise ValueError("stepguard: not a GuardedMegatronOptimizer state dict: it has a "
                             "'stepguard' entry but neither state_dict()'s keys ('optimizer', "
                             "'stepguard') nor sharded_state_dict()'s form")
        # The guard's part is checked whole first, and goes back if Megatron's part then fails.
        before = self.guard.guard_state_dict()
        self.guard.load_guard_state_dict(record)
        try:
            with torch.no_grad():
                self._megatron.load_state_dict(megatron_part)
        except BaseException:
            self.guard.load_guard_state_dict(before)
            raise


# The guard's entry in Megatron's state dicts, and the form sharded_state_dict() gives it.
_SHARDED_FORMAT = "stepguard-megatron-1"


def _refuse_unguarded(inner, chunks):
    """Refuses what the guarded step cannot guard yet, naming why: a second caller of
    grad_scale_func (MoE, MTP, an attention variant with a loss) and Megatron's own
    norm-threshold skip (which the guarded step bypasses)."""
    for chunk in chunks:
        config = getattr(chunk, "config", None)
        if getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False):
            raise ValueError("stepguard: Megatron-FSDP is not guarded yet (not run with the "
                             "guard; its clip uses decoupled gradients)")
        tagged = sorted({str(getattr(p, "grad_norm_group")) for p in chunk.parameters()
                         if getattr(p, "grad_norm_group", None) is not None})
        if tagged:  # megatron-core 0.19: a group with its own norm and clip
            raise ValueError("stepguard: parameters in Megatron's separate grad-norm groups %s "
                             "(their own norm and clip) are not guarded yet" % tagged)
        if (getattr(config, "num_moe_experts", None) is not None
                and getattr(getattr(inner, "config", None), "fp16", False)):
            # From the config, so that every rank refuses (a pipeline stage without MoE layers
            # has a chain of one).
            raise ValueError("stepguard: fp16 with MoE (a ChainedOptimizer of the dense and "
                             "expert optimizers, each with its own grad scaler) is not guarded "
                             "yet; use bf16")
        if getattr(config, "mtp_num_layers", None) is not None:
            raise ValueError("stepguard: multi-token-prediction models are not guarded yet (not "
                             "run with the guard)")
        if (getattr(config, "experimental_attention_variant", None) == "dsa"
                or getattr(config, "experimental_attention_variant_loss_scale_func",
                           None) is not None):
            raise ValueError("stepguard: this model's attention variant has a loss of its own: "
                             "Megatron also calls grad_scale_func for its scale, which the "
                             "guard would take for the step's loss")
    threshold = getattr(getattr(inner, "config", None), "grad_norm_skip_threshold", math.inf)
    if threshold is not None and math.isfinite(threshold):
        raise ValueError("stepguard: OptimizerConfig.grad_norm_skip_threshold=%r is Megatron's "
                         "own skip, which this guarded step would bypass: leave it at its "
                         "default (inf) and let the policy skip" % threshold)


def _scale_of(grad_scaler):
    """(scale, floor, gradients_scaled=False) of Megatron's grad scaler (fp16), or None: a
    DynamicGradScaler backs off to its min_scale; a ConstantGradScaler never backs off (its
    floor is its scale). Megatron's prepare_grads() unscales the main gradients."""
    if grad_scaler is None:
        return None
    # Megatron's device tensors, read with the step's one read (the step buffer carries them).
    scale = grad_scaler.scale
    floor = getattr(grad_scaler, "min_scale", None)
    return scale, scale if floor is None else floor, False


def _inner_optimizers(megatron_optimizer):
    """The Megatron optimizers the step runs: one, or a ChainedOptimizer's (MoE: the dense and
    the expert parameters' optimizers, stepped as one step with one norm)."""
    chained = getattr(megatron_optimizer, "chained_optimizers", None)
    if chained is None:
        return [megatron_optimizer]
    chained = [o for o in chained if not getattr(o, "is_stub_optimizer", False)]
    if not chained:
        raise ValueError("stepguard: this ChainedOptimizer has no optimizer with parameters on "
                         "this rank")
    if len(chained) > 1:
        kinds = {type(o).__name__ == "DistributedOptimizer" for o in chained}
        if len(kinds) > 1:
            raise ValueError("stepguard: this ChainedOptimizer mixes the distributed optimizer "
                             "with another; the Megatron integration guards chains of one kind")
        if any(getattr(o, "grad_scaler", None) is not None for o in chained):
            raise ValueError("stepguard: fp16 with a ChainedOptimizer of %d optimizers (MoE) is "
                             "not guarded yet (each has its own grad scaler); use bf16"
                             % len(chained))
    return chained


def _main_to_model_copy(inner):
    """Megatron's copy of ``inner``'s main parameters into the model's (its step runs it after
    the update; a rollback runs it after the restore): None for an FP32Optimizer, whose main
    parameters are the model's. Told apart by type, not by the name's presence: a release that
    renamed the function is refused here instead of a rollback that leaves the model's weights
    as they were."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MixedPrecisionOptimizer
    if isinstance(inner, FP32Optimizer):
        return None
    copy = getattr(inner, "_copy_main_params_to_model_params", None)
    if not isinstance(inner, MixedPrecisionOptimizer) or not callable(copy):
        raise RuntimeError(
            "stepguard: the Megatron optimizer %s has no _copy_main_params_to_model_params, which "
            "a rollback relies on to copy the restored main (fp32) weights into the model's "
            "weights (Float16OptimizerWithFloat16Params and DistributedOptimizer have it in the "
            "tested releases, 0.16.1 to 0.19.2): this Megatron release is not supported"
            % type(inner).__name__)
    return copy


def _aligned_main_params(inners, chunks):
    """(name, main parameter or None, model parameter) for every trainable parameter of the model
    chunks, in the model's order. A main parameter
    is the fp32 copy (bf16), the model's own (fp32), or this rank's shard of it (the
    distributed optimizer); None where the parameter has no shard on this rank."""
    main_of = {}
    stepped = set()
    for inner in inners:
        for model_attr, main_attr in (("float16_groups", "fp32_from_float16_groups"),
                                      ("model_float16_groups", "shard_fp32_from_float16_groups"),
                                      ("model_fp32_groups", "shard_fp32_groups")):
            for model_group, main_group in zip(getattr(inner, model_attr, []),
                                               getattr(inner, main_attr, [])):
                for model_param, main_param in zip(model_group, main_group):
                    main_of[id(model_param)] = main_param
        stepped |= {id(p) for g in inner.optimizer.param_groups for p in g["params"]}
    out = []
    for index, chunk in enumerate(chunks):
        module = getattr(chunk, "module", chunk)
        # Several model chunks (the interleaved schedule) name their layers alike: the chunk's
        # index tells them apart, as Megatron-LM's checkpoints do (model0, model1, ...).
        prefix = "model%d." % index if len(chunks) > 1 else ""
        for name, p in module.named_parameters():
            name = prefix + name
            if not p.requires_grad:
                continue
            main = main_of.get(id(p), p if id(p) in stepped else None)
            out.append((check_name(name, "parameter name"), main, p))
    if len([m for _, m, _ in out if m is not None]) != len(stepped):
        raise ValueError("stepguard: the optimizer steps parameters that are not in the model "
                         "chunks given (pass the chunks it was built for)")
    return out


class _MegatronPort(TorchOptimPort):
    """The torch optimizer inside Megatron's: its main parameters, gradients and state. The
    parameters and gradients the engine inspects are one entry per model parameter of this rank's
    pipeline stage (an empty tensor where this rank holds no shard of it), each placed as
    Megatron holds it (``layout()``); the optimizer state is this rank's. The update is
    Megatron's clip with the agreed norm, its zero count and ``step_with_ready_grads()``."""

    def __init__(self, megatron_optimizer, inners, chunks, process_group):
        aligned = _aligned_main_params(inners, chunks)
        optimizer = inners[0].optimizer if len(inners) == 1 else ChainedTorchOptimizer(
            [inner.optimizer for inner in inners])
        super().__init__(optimizer, [(n, m) for n, m, _ in aligned if m is not None])
        self.megatron = megatron_optimizer
        self.inner = inners[0]
        self.inners = inners
        self.copies = [_main_to_model_copy(inner) for inner in inners]
        self.result = None
        self.verdict = None
        self.framework_norm = False  # Megatron's own norm for its clip (the user's choice)
        self.scale = None  # this step's framework_loss_scale() (fp16), set by step()
        self._aligned_names = [n for n, _, _ in aligned]
        self._aligned = [m if m is not None else torch.empty(0) for _, m, _ in aligned]
        world = torch.distributed.get_world_size(process_group) if process_group is not None \
            else 1
        self._layout = _placements([p for _, _, p in aligned], self.sharded_state(), world)

    def parameters(self):
        super().parameters()  # the optimizer's own, for its state
        return self._aligned, self._aligned_names

    def gradients(self):
        return [p.grad if p.numel() else None for p in self._aligned]

    def sharded_state(self):
        return type(self.inner).__name__ == "DistributedOptimizer"

    def framework_loss_scale(self):
        return self.scale

    def update(self):
        """Runs between the guard's verdict (``self.verdict``, set by ``step()``) and settle."""
        v = self.verdict
        config = self.inner.config
        decoupled = getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
        # Megatron's clip and the policy's, one factor: the smaller target wins. The total norm
        # is the agreed one (under MoE, of the dense and expert parameters together, as the
        # ChainedOptimizer's): Megatron computes none of its own (framework_norm: its own).
        targets = [t for t in (config.clip_grad, v.clip_norm) if t is not None and t > 0.0]
        grad_norm = v.grad_norm
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
        if self.framework_norm and config.clip_grad > 0.0:
            # Megatron's own norm and clip, as its step() computes them (clip_grad_norm); the
            # policy's clip on top, from what Megatron's clip left.
            grad_norm = self.megatron.get_grad_norm()
            for inner in self.inners:
                params = inner.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, config.clip_grad, grad_norm, decoupled)
            targets = [v.clip_norm] if v.clip_norm is not None and v.clip_norm > 0.0 else []
            left = grad_norm * min(1.0, config.clip_grad / (grad_norm + 1e-6))
            if targets and math.isfinite(left) and left > targets[0]:
                for inner in self.inners:
                    params = inner.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, targets[0], left, decoupled)
        elif targets:
            for inner in self.inners:
                params = inner.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, min(targets), grad_norm, decoupled)
        zeros = (sum(inner.count_zeros() for inner in self.inners)
                 if config.log_num_zeros_in_grad else None)
        success = self.megatron.step_with_ready_grads()
        self.result = (success, grad_norm, zeros)

    def after_restore(self):
        """The restored main parameters into the model's, as Megatron's step copies them."""
        for copy in self.copies:
            if copy is not None:
                copy()
        if self.sharded_state() and not self.inner.ddp_config.overlap_param_gather:
            for chunk in self.inner.model_chunks:
                chunk.start_param_sync()  # every rank restores its shard; all-gather the rest


def _placements(model_params, distributed_optimizer, world):
    """How the job holds each main gradient, from Megatron's parallel state and marks: the copies
    of one gradient are its tensor-parallel duplicates (no ``tensor_model_parallel`` mark), the
    tied embedding's two stages (``shared_embedding``) and, unless the distributed optimizer
    shards it, the data-parallel replicas. An expert's parameter (MoE: ``allreduce`` False) is
    held by its expert-parallel rank alone, duplicated over the expert tensor-parallel ranks
    (unless split among them) and replicated over the expert data-parallel ones."""
    from megatron.core import parallel_state as ps
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    dp = 1 if distributed_optimizer else ps.get_data_parallel_world_size(
        with_context_parallel=True)
    experts = any(not getattr(p, "allreduce", True) for p in model_params)
    etp = ps.get_expert_tensor_parallel_world_size() if experts else 1
    edp = 1 if distributed_optimizer or not experts else \
        ps.get_expert_data_parallel_world_size()
    out = []
    for p in model_params:
        tensor_parallel = bool(getattr(p, "tensor_model_parallel", False))
        if not getattr(p, "allreduce", True):  # an expert's
            duplicates = 1 if tensor_parallel else etp
            copies = duplicates * edp
        else:
            tied = 2 if pp > 1 and getattr(p, "shared_embedding", False) else 1
            duplicates = (1 if tensor_parallel else tp) * tied
            copies = duplicates * dp
        if copies == world:
            out.append(_C.Placement.replica())
        elif duplicates > 1:
            out.append(_C.Placement.replicated(copies))
        else:
            out.append(_C.Placement.shard(copies))
    return out

"""stepguard inside Megatron-core: a guarded optimizer that stands where Megatron's optimizer
stands.

Wrap what ``get_megatron_optimizer`` returns; Megatron's training loop is unchanged::

    optimizer = get_megatron_optimizer(optimizer_config, model_chunks)
    optimizer = stepguard.integrations.megatron.GuardedMegatronOptimizer(
        optimizer, model_chunks, policy="run.yaml")
    config.grad_scale_func = optimizer.scale_loss   # Megatron-LM's training.py does this itself
    ...
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()

``step()`` runs Megatron's own stages with the guard between them: ``prepare_grads()`` (model
gradients into the fp32 main gradients; each rank's shard under the distributed optimizer), the
guard's verdict on those main gradients (one collective), then on an applied step Megatron's grad
norm, clipping, zero count and ``step_with_ready_grads()`` (the main parameters copied into the
model's, all-gathered under the distributed optimizer). It returns Megatron's
``(update_successful, grad_norm, num_zeros_in_grad)``: the values Megatron's optimizer returns on
a clean step, ``(False, None, None)`` on a step the guard did not apply (the training loop then
counts a skipped iteration and does not step its LR scheduler). A rollback restores the fp32 main
parameters and the optimizer state (each rank its shard under the distributed optimizer) and
copies them into the model's parameters, as Megatron's step does.

Megatron's ``grad_scale_func`` records each micro-batch's loss (Megatron divides it by the number
of micro-batches: the step's loss is their sum). Tested with megatron-core 0.16.1 (Python 3.11)
and 0.19.2 (Python 3.12 and later; ``TESTED_VERSIONS``): an older release is refused at attach,
a newer one warned about. fp32
(``FP32Optimizer``), bf16 (``Float16OptimizerWithFloat16Params``) and the distributed optimizer,
one model chunk. Refused with a message: fp16 (Megatron's grad scaler owns the loss scale), a
``ChainedOptimizer`` of several optimizers (expert and dense parameters, several chunks), and MoE
or multi-token-prediction models (Megatron calls ``grad_scale_func`` for their auxiliary losses'
scale too). Tensor and pipeline parallelism are not tested yet.
"""

import math
import warnings

import torch
from packaging.version import InvalidVersion, Version

from .._guard import GuardedOptimizer
from .._port import TorchOptimPort, check_name


# The oldest and the newest megatron-core release the framework tests ran (README "Supported
# versions"): the public stages used here (prepare_grads, step_with_ready_grads, ChainedOptimizer,
# get_forward_backward_func) are in both.
TESTED_VERSIONS = ("0.16.1", "0.19.2")


def check_megatron_version(version=None):
    """Refuses a megatron-core older than the tested range and warns about a newer one, by release
    number ("0.19.2rc1" and "0.19.2+78b9952" are 0.19.2). ``version``: the installed one when left
    out (``__shortversion__``: megatron-core 0.19 appends "+<git hash>" to ``__version__`` when
    it is installed inside a git checkout)."""
    if version is None:
        import megatron.core
        version = getattr(megatron.core, "__shortversion__",
                          getattr(megatron.core, "__version__", "unknown"))
    oldest, newest = TESTED_VERSIONS
    try:
        found = Version(str(version)).release
    except InvalidVersion:
        raise RuntimeError("stepguard: cannot read the megatron-core version %r (the releases "
                           "tested are %s to %s)" % (version, oldest, newest)) from None
    if found < Version(oldest).release:
        raise RuntimeError("stepguard: megatron-core %s is older than the releases tested "
                           "(%s to %s); install one of those" % (version, oldest, newest))
    if found > Version(newest).release:
        warnings.warn("stepguard: megatron-core %s is newer than the releases tested (%s to %s)"
                      % (version, oldest, newest), RuntimeWarning, stacklevel=3)


class GuardedMegatronOptimizer:
    """A guarded Megatron optimizer (see the module's docstring). Attributes it does not define
    are the wrapped optimizer's, so Megatron's training and checkpointing code take it as is."""

    def __init__(self, megatron_optimizer, model=None, *, policy=None, policy_yaml=None,
                 process_group=None, **options):
        """``model``: the model chunk (or list of chunks) the optimizer was built for, which
        names the parameters in reports; the optimizer's own ``model_chunks`` when left out."""
        check_megatron_version()
        inner = _single_optimizer(megatron_optimizer)
        chunks = getattr(inner, "model_chunks", None) if model is None else model
        if chunks is None:
            raise TypeError("stepguard: this %s does not know its model: pass the model chunks "
                            "it was built for (GuardedMegatronOptimizer(optimizer, model))"
                            % type(inner).__name__)
        chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        _refuse_unguarded(inner, chunks)
        self._megatron = megatron_optimizer
        self._inner = inner
        sharded = type(inner).__name__ == "DistributedOptimizer"
        if process_group is None and torch.distributed.is_initialized():
            # Every rank of the job takes each step's decision together: Megatron's grad-stats
            # group is the model-parallel one, which leaves out the data-parallel replicas.
            process_group = torch.distributed.group.WORLD
        options.setdefault("sharded_gradients", sharded)
        if options["sharded_gradients"] != sharded:
            raise ValueError("stepguard: sharded_gradients=%r does not match this optimizer "
                             "(%s): leave it out" % (options["sharded_gradients"],
                                                     type(inner).__name__))
        self._port = _MegatronPort(megatron_optimizer, inner, chunks)
        self.guard = GuardedOptimizer(inner.optimizer, port=self._port, policy=policy,
                                      policy_yaml=policy_yaml, process_group=process_group,
                                      **options)
        self._losses = []
        self.last_report = None

    def __getattr__(self, name):  # everything else is Megatron's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._megatron, name)

    def scale_loss(self, loss):
        """Megatron's ``grad_scale_func``: records the micro-batch's loss for the guard and scales
        it as Megatron's optimizer does."""
        self._losses.append(loss.detach().float().reshape(()))
        return self._megatron.scale_loss(loss)

    def record_loss(self, loss):
        """The step's loss, for a loop that does not pass ``scale_loss`` as grad_scale_func."""
        self._losses = [loss.detach().float().reshape(())]

    @torch.no_grad()
    def step(self):
        if self._megatron.prepare_grads():  # only a grad scaler finds inf; refused above
            raise RuntimeError("stepguard: Megatron's prepare_grads() found inf without a scaler")
        loss = torch.stack(self._losses).sum() if self._losses else None
        self._losses = []
        self._port.result = None
        report = self.guard.step(loss)
        self.last_report = report
        if not report.applied:
            return False, None, None
        return self._port.result

    def zero_grad(self, set_to_none=True):
        self._megatron.zero_grad(set_to_none)

    def state_dict(self):
        return {"optimizer": self._megatron.state_dict(), "stepguard": self.guard._guard.record()}

    def load_state_dict(self, state_dict):
        if "stepguard" not in state_dict or "optimizer" not in state_dict:
            raise ValueError("stepguard: not a GuardedMegatronOptimizer state dict (it needs the "
                             "keys 'optimizer' and 'stepguard')")
        # As GuardedOptimizer.load_state_dict: the guard's part is checked whole first, and goes
        # back if Megatron's part then fails.
        before = self.guard._guard.record()
        self.guard._guard.load_record(state_dict["stepguard"])
        try:
            self._megatron.load_state_dict(state_dict["optimizer"])
        except BaseException:
            self.guard._guard.load_record(before)
            raise


def _refuse_unguarded(inner, chunks):
    """Refuses what the guarded step cannot guard yet, naming why: a second caller of
    grad_scale_func (MoE, MTP, an attention variant with a loss), Megatron's own norm-threshold
    skip (which the guarded step bypasses), and fp16 (Megatron's grad scaler)."""
    for chunk in chunks:
        config = getattr(chunk, "config", None)
        if (getattr(config, "num_moe_experts", None) is not None
                or getattr(config, "mtp_num_layers", None) is not None):
            raise ValueError("stepguard: MoE and multi-token-prediction models are not guarded "
                             "yet: Megatron also calls grad_scale_func for their auxiliary "
                             "losses' scale, which the guard would take for the step's loss")
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
    if getattr(inner, "grad_scaler", None) is not None:
        raise ValueError("stepguard: this Megatron optimizer has a grad scaler (fp16); its "
                         "dynamic loss scale would fight the guard's. Guard bf16 or fp32")


def _single_optimizer(megatron_optimizer):
    chained = getattr(megatron_optimizer, "chained_optimizers", None)
    if chained is None:
        return megatron_optimizer
    if len(chained) != 1:
        raise ValueError("stepguard: this ChainedOptimizer chains %d optimizers (expert and dense "
                         "parameters, or several model chunks); the Megatron integration guards "
                         "one" % len(chained))
    return chained[0]


def _aligned_main_params(inner, chunks):
    """(name, main parameter or None) for every trainable parameter of the model chunks, in the
    model's order on every rank: the engine's contract for sharded gradients. A main parameter
    is the fp32 copy (bf16), the model's own (fp32), or this rank's shard of it (the
    distributed optimizer); None where the parameter has no shard on this rank."""
    main_of = {}
    for model_attr, main_attr in (("float16_groups", "fp32_from_float16_groups"),
                                  ("model_float16_groups", "shard_fp32_from_float16_groups"),
                                  ("model_fp32_groups", "shard_fp32_groups")):
        for model_group, main_group in zip(getattr(inner, model_attr, []),
                                           getattr(inner, main_attr, [])):
            for model_param, main_param in zip(model_group, main_group):
                main_of[id(model_param)] = main_param
    stepped = {id(p) for g in inner.optimizer.param_groups for p in g["params"]}
    out = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            main = main_of.get(id(p), p if id(p) in stepped else None)
            out.append((check_name(name, "parameter name"), main))
    if len([m for _, m in out if m is not None]) != len(stepped):
        raise ValueError("stepguard: the optimizer steps parameters that are not in the model "
                         "chunks given (pass the chunks it was built for)")
    return out


class _MegatronPort(TorchOptimPort):
    """The torch optimizer inside Megatron's: its main parameters, gradients and state. The
    parameters and gradients the engine inspects are one entry per model parameter, on every
    rank (an empty tensor where this rank holds no shard of it); the optimizer state is this
    rank's. The update is Megatron's grad norm, clipping, zero count and
    ``step_with_ready_grads()``."""

    def __init__(self, megatron_optimizer, inner, chunks):
        aligned = _aligned_main_params(inner, chunks)
        super().__init__(inner.optimizer, [(n, m) for n, m in aligned if m is not None])
        self.megatron = megatron_optimizer
        self.inner = inner
        self.result = None
        self._aligned_names = [n for n, _ in aligned]
        self._aligned = [m if m is not None else torch.empty(0) for _, m in aligned]

    def parameters(self):
        super().parameters()  # the optimizer's own, for its state
        return self._aligned, self._aligned_names

    def gradients(self):
        return [p.grad if p.numel() else None for p in self._aligned]

    def sharded_state(self):
        return type(self.inner).__name__ == "DistributedOptimizer"

    def update(self):
        clip = self.inner.config.clip_grad
        grad_norm = self.inner.clip_grad_norm(clip) if clip > 0.0 else self.inner.get_grad_norm()
        zeros = self.inner.count_zeros() if self.inner.config.log_num_zeros_in_grad else None
        success = self.megatron.step_with_ready_grads()
        self.result = (success, grad_norm, zeros)

    def after_restore(self):
        """The restored main parameters into the model's, as Megatron's step copies them."""
        if hasattr(self.inner, "_copy_main_params_to_model_params"):
            self.inner._copy_main_params_to_model_params()
        if self.sharded_state() and not self.inner.ddp_config.overlap_param_gather:
            for chunk in self.inner.model_chunks:
                chunk.start_param_sync()  # every rank restores its shard; all-gather the rest

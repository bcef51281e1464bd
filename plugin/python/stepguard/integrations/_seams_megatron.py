"""The Megatron-core integration's declared seams (stepguard.integrations.megatron): what
``GuardedMegatronOptimizer`` relies on in Megatron beyond its public optimizer stages
(``prepare_grads``, ``get_grad_norm``, ``clip_grad_by_total_norm_fp32``, ``count_zeros``,
``step_with_ready_grads``). It writes nothing on Megatron's objects (it wraps the optimizer), so
every seam is one it reads, calls or follows. Fingerprints of the tested releases: 0.16.1 (the
installed one of ``make test``) and 0.19.2 (read from its wheel's sources; it needs Python 3.12).
Merged into ``_seams.SEAMS``/``TESTED_SOURCES`` under "megatron"; checked when the guarded
optimizer is made."""

from ._seams import Seam

_O = "megatron.core.optimizer.optimizer."
_F = _O + "Float16OptimizerWithFloat16Params."
_D = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."

TESTED = {  # megatron-core 0.16.1, 0.19.2
    _O + "MixedPrecisionOptimizer.step": {"10ed0cb46699b1cc", "6c43245d12f304e2"},
    _O + "FP32Optimizer.step": {"c376b9dec1eab575", "4eb0a24a74cf34ee"},
    _O + "ChainedOptimizer.step": {"efe98d8282885005", "677190157ebd3f3a"},
    _O + "MegatronOptimizer.clip_grad_norm": {"b89f821efcb689a5", "bebe0b670db63520"},
    _O + "MixedPrecisionOptimizer.prepare_grads": {"c4cbff4656175d93"},
    _F + "_copy_main_params_to_model_params": {"6c28b071f2b1d890"},
    _D + "_copy_main_params_to_model_params": {"4f50ef1e31d59290", "4a9ee74491d2b94d"},
    _F + "__init__": {"fe98719f827f4f1e", "56cba022b5e32c3d"},
    _D + "_build_model_and_main_param_groups": {"2d18fa9c2819f73b", "fd71110e7d5d47b7"},
    _D + "__init__": {"9065c18bc9116278", "81e95876695481da"},
}

SEAMS = [
    Seam(_O + "MegatronOptimizer.step", "follows",
         "the guarded step runs the stages of Megatron's step() in its order (prepare_grads, the "
         "clip from the total norm, the zero count, step_with_ready_grads) with the verdict "
         "between them; a stage a release adds would be left out",
         (_O + "MixedPrecisionOptimizer.step", _O + "FP32Optimizer.step",
          _O + "ChainedOptimizer.step", _O + "MegatronOptimizer.clip_grad_norm"),
         restored=False),
    Seam(_O + "MixedPrecisionOptimizer.prepare_grads", "follows",
         "fp16: the grad scaler's scale read before prepare_grads() is the one the step's "
         "backward used (prepare_grads unscales by it, then backs it off or grows it)",
         (_O + "MixedPrecisionOptimizer.prepare_grads",), restored=False),
    Seam(_O + "MixedPrecisionOptimizer._copy_main_params_to_model_params", "calls",
         "a rollback copies the restored main (fp32) parameters into the model's, as Megatron's "
         "step does after the update",
         (_F + "_copy_main_params_to_model_params", _D + "_copy_main_params_to_model_params"),
         restored=False),
    Seam(_F + "fp32_from_float16_groups", "reads",
         "bf16/fp16: the fp32 main parameter of each model parameter (its name in reports, its "
         "layout), with float16_groups", (_F + "__init__",), restored=False),
    Seam(_D + "shard_fp32_from_float16_groups", "reads",
         "the distributed optimizer: this rank's shard of each model parameter's main parameter "
         "(with model_float16_groups, model_fp32_groups, shard_fp32_groups)",
         (_D + "__init__", _D + "_build_model_and_main_param_groups"), restored=False),
]

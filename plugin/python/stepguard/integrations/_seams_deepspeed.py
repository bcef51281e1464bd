"""The DeepSpeed integration's declared seams (stepguard.integrations.deepspeed and its layouts):
every attribute of DeepSpeed's objects it replaces, writes, or reads or calls privately, and the
DeepSpeed functions whose code defines the behaviour relied on, fingerprinted for the tested
release (0.19.8). Merged into ``_seams.SEAMS``/``TESTED_SOURCES`` under "deepspeed"; checked at
``guard_engine``. What a step substitutes is restored when the step returns; what attach writes,
at ``EngineGuard.detach()``."""

from ._seams import Seam

_E = "deepspeed.runtime.engine.DeepSpeedEngine."
_F = "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer."
_U = "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer."
_B = "deepspeed.runtime.bf16_optimizer.BF16_Optimizer."
_Z = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer."
_Z3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3."
_S = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler."

TESTED = {  # deepspeed 0.19.8
    _E + "_take_model_step": {"b5e1145cf37b0f2a"},
    _E + "backward": {"947f39bc03a5b29f"},
    _E + "scale": {"495848528915c9e7"},
    _E + "clip_fp32_gradients": {"9ff142d47efad2bc"},
    _F + "step": {"6d5a1f80f8a9c827"},
    _F + "_skip_invalid_grad_norm": {"6cb95cd19e09aa24"},
    _U + "step": {"e06fd288a7cc55a2"},
    _U + "_skip_invalid_grad_norm": {"0759b6444841d9bc"},
    _B + "step": {"2106bc88c518d5fb"},
    _Z + "step": {"279ae7c6a4e87667"},
    _Z + "check_overflow": {"f968102a73733534"},
    _Z + "_wait_for_offload_copies": {"c11fe317a52eb51f"},
    _Z3 + "step": {"7f4e65c385a30e4d"},
    _Z3 + "_overflow_check_and_loss_scale_update": {"31641f11ea438f17"},
    _Z3 + "_get_norm_groups": {"defda124c31c43d0"},
    _Z3 + "_reassign_or_swap_out_partitioned_parameters": {"0fd6afef7c78aba3"},
    _Z3 + "_offload_grad_partition_at_boundary": {"f03c6a33201a054c"},
    _S + "update_scale": {"a37174bac3f06bb1"},
}

SEAMS = [
    Seam(_E + "backward", "replaces",
         "each micro-batch's loss reaches the guard (DeepSpeed has no loss hook)",
         (_E + "backward",)),
    Seam(_E + "scale", "replaces",
         "the same for DeepSpeed's manual path, engine.scale(loss).backward()", (_E + "scale",)),
    Seam(_E + "optimizer.step", "replaces",
         "the engine's optimizer step is the guarded step: the verdict, then DeepSpeed's own "
         "step or its own overflow path", (_E + "_take_model_step",)),
    Seam(_E + "clip_fp32_gradients", "replaces",
         "fp32 without ZeRO, with clipping: the engine's clip runs inside the guarded step, after "
         "the verdict (from the agreed norm, or DeepSpeed's own with framework_norm)",
         (_E + "_take_model_step", _E + "clip_fp32_gradients")),
    Seam(_E + "basic_optimizer.overflow", "writes",
         "fp32 without ZeRO: the engine reads its optimizer's overflow to count a skipped step "
         "and hold the LR scheduler", (_E + "_take_model_step",)),
    Seam(_F + "_skip_invalid_grad_norm", "calls",
         "bf16 without ZeRO (FP16_Optimizer): a skip is DeepSpeed's own path for a step it does "
         "not apply", (_F + "step", _F + "_skip_invalid_grad_norm"), restored=False),
    Seam(_U + "_skip_invalid_grad_norm", "calls",
         "bf16 without ZeRO (FP16_UnfusedOptimizer): the same",
         (_U + "step", _U + "_skip_invalid_grad_norm"), restored=False),
    Seam(_B + "overflow", "writes",
         "BF16_Optimizer: a skip sets the flags of its own invalid-norm branch and releases the "
         "gradients with its clear_hp_grads/clear_lp_grads", (_B + "step",), restored=False),
    Seam(_B + "_global_grad_norm", "writes",
         "BF16_Optimizer: the same branch's reported norm (inf) on a skip", (_B + "step",),
         restored=False),
    Seam(_Z + "scaled_global_norm", "replaces",
         "ZeRO 1/2, for the step only: DeepSpeed's clip and reported norm take the agreed norm "
         "(no second norm and all-reduce); not with framework_norm", (_Z + "step",)),
    Seam(_Z + "check_grad_overflow", "writes",
         "ZeRO 1/2, for the step only: no second overflow check on an applied step (the verdict "
         "found none), DeepSpeed's overflow path on a skip", (_Z + "step",)),
    Seam(_Z + "check_overflow", "replaces",
         "ZeRO 1/2, for a skipped step only: DeepSpeed's overflow path runs (zero_grad, scaler "
         "told, engine counts the skip)", (_Z + "step", _Z + "check_overflow")),
    Seam(_Z3 + "check_overflow", "replaces",
         "ZeRO 3, for the step only: the verdict's overflow (none on an applied step; a skip "
         "takes DeepSpeed's overflow path); not on an applied step with framework_norm",
         (_Z3 + "step", _Z3 + "_overflow_check_and_loss_scale_update")),
    Seam(_Z3 + "_get_norm_groups", "replaces",
         "ZeRO 3, for the step only: DeepSpeed's clip and reported norm take the agreed norm (a "
         "skip: an invalid norm); not on an applied step with framework_norm. With optimizer "
         "offload to the CPU the verdict reads the gradients where DeepSpeed copies them, beside "
         "the host masters",
         (_Z3 + "step", _Z3 + "_get_norm_groups", _Z3 + "_offload_grad_partition_at_boundary")),
    Seam(_Z3 + "_reassign_or_swap_out_partitioned_parameters", "calls",
         "ZeRO 3, after a rollback: the restored masters go into the partitioned parameters as "
         "DeepSpeed's checkpoint load puts them",
         (_Z3 + "_reassign_or_swap_out_partitioned_parameters",), restored=False),
    Seam(_S + "raise_error_at_min_scale", "writes",
         "fp16, for a skipped step only: at DeepSpeed's min_loss_scale the policy decides "
         "instead of DeepSpeed's exit", (_S + "update_scale",)),
    Seam(_Z + "_wait_for_offload_copies", "calls",
         "ZeRO 1/2 with optimizer offload to the CPU: the gradients' copies into the host buffer "
         "complete before the verdict reads them (DeepSpeed's step waits for them itself)",
         (_Z + "step", _Z + "_wait_for_offload_copies"), restored=False),
]

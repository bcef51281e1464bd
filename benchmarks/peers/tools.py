"""Each tool's training iteration through its own code, not a re-implementation:

- stepguard: ``stepguard.GuardedOptimizer`` over ``torch.optim.AdamW`` (default policy);
- torch: ``torch.amp.GradScaler("cpu")`` (``unscale_`` runs ``_amp_foreach_non_finite_check_and_
  unscale_``), ``step``, ``update``;
- olmo_core: ``olmo_core.optim.SkipStepAdamW`` (foreach), fed the all-reduced loss and the global
  grad norm as OLMo-core's TransformerTrainModule does;
- deepspeed: a ``deepspeed.initialize`` engine, ZeRO stage 1 (``DeepSpeedZeroOptimizer``: the bf16
  ``check_overflow``, and for fp32 the invalid-norm overflow of ``scaled_global_norm``);
- megatron: Megatron-core's ``DistributedDataParallel`` (``check_for_nan_in_grad``: a norm per
  bucket before the collective) and ``get_megatron_optimizer`` (bf16: ``found_inf`` with a MAX
  all-reduce), and Megatron-LM's loss checks through the rerun state machine (NaN, Inf: fatal;
  ``is_unexpectedly_large`` 10x over the first 100 values: a warning), under
  tests/frameworks/megatron_cpu.py's CPU shim.

``iteration(x, y, loss_factor)`` runs forward, backward, the gradient average and the tool's
step, and returns what the tool did: nothing, skip, rollback, lr, clip, alert or abort.
``check_seconds`` is the tool's own check in that iteration. A tool's check is timed by a timer
around the tool's own method, set on the instance; nothing in the tool is replaced."""

import functools
import os
import time

import torch
import torch.distributed as dist

from .common import agree_any, average_gradients, loss_of

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
POLICY = os.path.join(ROOT, "configs", "policies", "default.yaml")
LR, WEIGHT_DECAY = 1e-3, 0.01


class Aborted(Exception):
    """The tool stopped training (a fatal check)."""


def _timed(owner, name, sink):
    """Wraps ``owner.name`` on the instance so each call adds its seconds to ``sink[0]``."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink[0] += time.perf_counter() - t0
    setattr(owner, name, wrapper)


class Tool:
    name = ""
    runs = ""

    own_model = False  # True: its engine takes over the model's gradients (a copy for plain)

    def __init__(self, model, precision, world, group, coverage, micro_batch):
        self.model, self.precision, self.world, self.group = model, precision, world, group
        self.micro_batch = micro_batch
        self.coverage = coverage  # record actions (may read flags the cost loop must not)
        self.params = [p for p in model.parameters()]
        self.check_seconds = 0.0

    def param_groups(self):
        return self.optimizer.param_groups

    def backward(self, x, y, loss_factor):
        loss = loss_of(self.model(x), y) * loss_factor
        loss.backward()
        average_gradients(self.params, self.world)
        return loss.detach()


class Stepguard(Tool):
    name = "stepguard"
    runs = "stepguard.GuardedOptimizer(torch.optim.AdamW), configs/policies/default.yaml"

    def __init__(self, *args):
        super().__init__(*args)
        import stepguard
        self.optimizer = stepguard.GuardedOptimizer(
            torch.optim.AdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY),
            self.model.named_parameters(), policy=POLICY,
            process_group=self.group if self.world > 1 else None, collective_timeout=60)

    def iteration(self, x, y, loss_factor):
        report = self.optimizer.step(self.backward(x, y, loss_factor))
        self.optimizer.zero_grad()
        seconds = self.optimizer.stats().last_step_seconds
        self.check_seconds = seconds.inspect + seconds.agree + seconds.decide
        if report.aborted:
            raise Aborted(str(report.incident))
        if report.rolled_back:
            return "rollback"
        if report.skipped:
            return "skip"
        for action, word in (("lower_lr", "lr"), ("clip", "clip"), ("alert", "alert")):
            if action in report.actions:
                return word
        return "nothing"


class GradScalerTool(Tool):
    name = "torch_gradscaler"
    runs = "torch.amp.GradScaler('cpu'): unscale_ (_amp_foreach_non_finite_check_and_unscale_), " \
           "step, update; torch.optim.AdamW"

    def __init__(self, *args):
        super().__init__(*args)
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY)
        self.scaler = torch.amp.GradScaler("cpu")

    def iteration(self, x, y, loss_factor):
        loss = loss_of(self.model(x), y) * loss_factor
        self.scaler.scale(loss).backward()
        average_gradients(self.params, self.world)
        scale = self.scaler.get_scale()
        t0 = time.perf_counter()
        self.scaler.unscale_(self.optimizer)
        t1 = time.perf_counter()
        self.scaler.step(self.optimizer)  # reads found_inf on the host: skips on NaN/Inf
        t2 = time.perf_counter()
        self.scaler.update()
        self.check_seconds = (t1 - t0) + (time.perf_counter() - t2)
        self.optimizer.zero_grad()
        return "skip" if self.scaler.get_scale() < scale else "nothing"


class OlmoSkipStep(Tool):
    name = "olmo_core"
    runs = "olmo_core.optim.SkipStepAdamW(foreach=True): latest_loss (all-reduced mean), " \
           "latest_grad_norm (torch.nn.utils.get_total_norm), step_factor on the device"

    def __init__(self, *args):
        super().__init__(*args)
        from olmo_core.optim import SkipStepAdamW
        self.optimizer = SkipStepAdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY,
                                       foreach=True)
        self._sink = [0.0]
        _timed(self.optimizer, "get_step_factor", self._sink)

    def iteration(self, x, y, loss_factor):
        loss = self.backward(x, y, loss_factor).clone()
        t0 = time.perf_counter()
        if self.world > 1:  # as TransformerTrainModule: the loss is reduced right away
            dist.all_reduce(loss)
            loss.div_(self.world)
        self.optimizer.latest_loss = loss
        self.optimizer.latest_grad_norm = torch.nn.utils.get_total_norm(
            [p.grad for p in self.params if p.grad is not None])
        self._sink[0] = time.perf_counter() - t0
        self.optimizer.step()
        self.check_seconds = self._sink[0]
        self.optimizer.zero_grad()
        if self.coverage and float(self.optimizer.step_skipped) == 1.0:  # a host sync
            return "skip"
        return "nothing"


class DeepSpeedEngine(Tool):
    name = "deepspeed"
    runs = "deepspeed.initialize engine, ZeRO stage 1 (DeepSpeedZeroOptimizer): bf16 " \
           "check_overflow (check_grad_overflow), fp32 invalid-norm overflow; torch AdamW"

    own_model = True

    def __init__(self, *args):
        super().__init__(*args)
        model, precision = self.model, self.precision
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": self.micro_batch,
                  "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
                  "optimizer": {"type": "AdamW", "params": {
                      "lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
                  "zero_optimization": {"stage": 1}, "bf16": {"enabled": precision == "bf16"}}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=self.params, config=config)
        self._sink = [0.0]
        zero = self.engine.optimizer
        _timed(zero, "check_overflow", self._sink)  # bf16: the overflow check itself
        if precision == "fp32":  # fp32: the global norm is the check (an invalid norm skips)
            _timed(zero, "scaled_global_norm", self._sink)

    def iteration(self, x, y, loss_factor):
        skipped = self.engine.skipped_steps
        loss = loss_of(self.engine(x), y) * loss_factor
        self.engine.backward(loss)
        self._sink[0] = 0.0
        self.engine.step()
        self.check_seconds = self._sink[0]
        return "skip" if self.engine.skipped_steps > skipped else "nothing"


class MegatronCore(Tool):
    name = "megatron_core"
    runs = "megatron.core DistributedDataParallel(check_for_nan_in_grad) + " \
           "get_megatron_optimizer (bf16: found_inf, MAX all-reduce); Megatron-LM's loss checks " \
           "(rerun state machine: NaN/Inf fatal, is_unexpectedly_large 10x, 100 samples)"

    own_model = True

    def __init__(self, *args):
        super().__init__(*args)
        model, precision = self.model, self.precision
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.core.transformer.transformer_config import TransformerConfig
        bf16 = precision == "bf16"
        dtype = torch.bfloat16 if bf16 else torch.float32
        net = model.net
        config = TransformerConfig(num_layers=len(net.blocks), hidden_size=net.head.in_features,
                                   num_attention_heads=1, use_cpu_initialization=True,
                                   bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype)
        # Coverage: the same per-bucket check, called below with a flag the ranks agree on, so
        # a rank that raises does not leave the others waiting in the gradient collective.
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=False,
                                                   check_for_nan_in_grad=not self.coverage)
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, bf16=bf16, clip_grad=0.0),
            [self.ddp])
        self.rerun = get_rerun_state_machine()
        self.rerun.large_value_counts.clear()
        self.rerun.max_values.clear()
        self._sink = [0.0]
        for bucket_group in self.ddp.bucket_groups:
            _timed(bucket_group, "check_grads", self._sink)
        if hasattr(self.optimizer, "_unscale_main_grads_and_check_for_nan"):
            _timed(self.optimizer, "_unscale_main_grads_and_check_for_nan", self._sink)

    def _check_loss(self, loss):
        """Megatron-LM's loss_func checks; returns whether the spike check rejected the loss."""
        spiky = []

        def large(value):
            spiky.append(self.rerun.is_unexpectedly_large(value, threshold=10, context="loss"))
            return spiky[-1]
        self.rerun.validate_result(loss, torch.isnan, "found NaN in local forward loss calculation",
                                   fatal=True)
        self.rerun.validate_result(loss, torch.isinf, "found Inf in local forward loss calculation",
                                   fatal=True)
        self.rerun.validate_result(loss, large, "Spiky loss", fatal=False)
        return bool(spiky and spiky[-1])

    def _fatal(self, check):
        """Runs a fatal check; in coverage the ranks agree on whether any raised."""
        try:
            result, error = check(), None
        except RuntimeError as e:
            result, error = None, e
        if self.coverage and agree_any(error is not None, self.world):
            raise Aborted(str(error) if error else "another rank's check raised")
        if error is not None:
            raise error
        return result

    def iteration(self, x, y, loss_factor):
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._sink[0] = 0.0
        loss = loss_of(self.ddp(x), y) * loss_factor
        t0 = time.perf_counter()
        spiky = self._fatal(lambda: self._check_loss(loss.detach()))
        self._sink[0] += time.perf_counter() - t0
        loss.backward()
        if self.coverage:
            self._fatal(lambda: [g.check_grads(True, False) for g in self.ddp.bucket_groups])
        self.ddp.finish_grad_sync()
        success, _, _ = self.optimizer.step()
        self.check_seconds = self._sink[0]
        if not success:
            return "skip"
        return "alert" if spiky else "nothing"


TOOLS = [Stepguard, GradScalerTool, OlmoSkipStep, DeepSpeedEngine, MegatronCore]

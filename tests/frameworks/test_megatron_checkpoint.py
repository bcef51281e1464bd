"""The guard's state in Megatron's own checkpoints: dist_checkpointing (Megatron-LM's default) with
the real Megatron-core on CPU/Gloo, tensor parallel on 2 ranks, bf16 with and without the
distributed optimizer. A job saved at step 8 (after a skipped NaN step and a rolled-back spike
that lowered the LR factor) resumes in new processes and runs steps 9-12 bitwise as the
uninterrupted job, guard included (step count, totals, LR factor, data position); a checkpoint
saved without the guard loads into a guarded optimizer with a warning that the guard starts
fresh; the per-rank torch.save format of state_dict() resumes bitwise too."""

import hashlib
import json
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

import megatron.core  # noqa: F401  (a missing Megatron-core fails the test)
from conftest import spawn_ranks

STEPS, SAVE_AT, NAN_GRAD, SPIKE = 12, 8, 3, 6
MICRO = 2
TARGET = "decoder.layers.1.mlp.linear_fc2.weight"
EXPERT_TARGET = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"  # MoE's
CONFIGS = [False, True]  # the distributed optimizer
POLICY = """
version: 1
checkpoint: {snapshot_every: 2, snapshot_keep: 2}
detectors:
  loss_spike: {z: 6, warmup: 3, decay: 0.9, early_factor: 10}
rules:
  - {name: skip-nonfinite, on: nonfinite, action: skip_batch}
  - {name: rollback-loss-spike, on: loss_spike, action: rollback, skip_batches: 1}
  - {name: lower-lr-after-spike, on: loss_spike, action: lower_lr, factor: 0.5, floor: 0.1,
     recover_after: 100, recover_over: 100}
"""


def _build(distributed_optimizer, moe):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    # Tensor parallel TP=2, or MoE with expert parallel EP=2 (test_megatron_moe.py's model).
    parallel = (dict(num_moe_experts=4, expert_model_parallel_size=2, moe_router_topk=2,
                     moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="allgather",
                     ffn_hidden_size=32) if moe else dict(tensor_model_parallel_size=2))
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
                               pipeline_dtype=torch.bfloat16, **parallel)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False) if moe else \
        get_gpt_layer_local_spec()
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64,
                     max_sequence_length=16).to(torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                                       use_distributed_optimizer=distributed_optimizer)
    return model, config, get_megatron_optimizer(optimizer_config, [model])


def _guarded(distributed_optimizer, moe):
    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    model, config, megatron_optimizer = _build(distributed_optimizer, moe)
    optimizer = GuardedMegatronOptimizer(megatron_optimizer, model, policy_yaml=POLICY,
                                         collective_timeout=60)
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def _digest(model, optimizer):
    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().float().numpy().tobytes())
    for _, p, state in _adam_params(optimizer._megatron):  # every chained optimizer's
        h.update(p.detach().float().numpy().tobytes())
        for _, v in sorted(state.items()):
            if torch.is_tensor(v):
                h.update(v.detach().float().numpy().tobytes())
    return h.hexdigest()


def _train(model, optimizer, until):
    """Steps up to `until`, the batches drawn at the guard's data position (which a rollback moves
    on and a checkpoint carries). Returns {step: (outcome, digest, lr_factor)}."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    named = dict(model.module.named_parameters())
    out = {}
    while optimizer.guard.stats().step_count < until:
        stats = optimizer.guard.stats()
        step = stats.step_count + 1
        batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(
            100 * stats.data_position + i)) for i in range(MICRO)]
        factor = 300.0 if step == SPIKE else 1.0

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            positions = torch.arange(batch.shape[1]).unsqueeze(0).expand_as(batch)
            output = model(batch, positions, None, labels=batch)
            return output, lambda o: (o.float().mean() * factor, {})

        hook = None
        if step == NAN_GRAD and dist.get_rank() == 1:
            hook = named.get(TARGET, named.get(EXPERT_TARGET)).register_hook(
                lambda g: g * float("nan"))
        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches),
                                    model=[model], num_microbatches=MICRO, seq_length=8,
                                    micro_batch_size=2, forward_only=False)
        if hook is not None:
            hook.remove()
        optimizer.step()
        r = optimizer.last_report
        out[r.step] = (r.outcome, _digest(model, optimizer), r.lr_factor)
    return out


# What Megatron-LM's save_checkpoint passes by default (its --dist-ckpt-optim-fully-reshardable
# off): the distributed optimizer's state in data-parallel buckets.
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded(model, optimizer, is_loading=False):
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                      metadata=METADATA)}


def _adam_params(megatron_optimizer):
    """(param group, main parameter, its torch Adam state) of every optimizer Megatron chains."""
    for o in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                yield group, p, o.optimizer.state[p]


def _prime_adam_state(megatron_optimizer):
    """Megatron-core 0.16.1 with torch's Adam (no Apex or Transformer Engine, as on CPU):
    DistributedOptimizer.state_dict() asserts one Adam step value over the parameters' states, so
    sharded_state_dict(is_loading=True) fails on a fresh optimizer. The state a first step would
    have (step 0, zero moments); the load overwrites all of it."""
    for _, p, state in _adam_params(megatron_optimizer):
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                         exp_avg_sq=torch.zeros_like(p.data))


def _fix_adam_steps(megatron_optimizer):
    """The same pairing, dp_reshardable: torch Adam's per-parameter "step" is saved as a
    non-persistent object, so the load leaves the fresh optimizer's 0; the loaded param groups
    hold the right one."""
    for group, _, state in _adam_params(megatron_optimizer):
        if "step" in group and "step" in state:
            state["step"] = torch.tensor(float(group["step"]))


def _load(model, optimizer, directory, distributed_optimizer):
    from megatron.core import dist_checkpointing

    if distributed_optimizer:
        _prime_adam_state(optimizer._megatron)
    state = dist_checkpointing.load(_sharded(model, optimizer, is_loading=True), directory)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if distributed_optimizer:
        _fix_adam_steps(optimizer._megatron)


def _save_main(rank, world, port, out_dir, ckpt_dir, moe):
    from megatron.core import dist_checkpointing

    _init(rank, world, port, moe)
    results = {}
    for distributed_optimizer in CONFIGS:
        key = "distopt" if distributed_optimizer else "ddp"
        model, optimizer = _guarded(distributed_optimizer, moe)
        results[key] = {"whole": _train(model, optimizer, STEPS)}
        model, optimizer = _guarded(distributed_optimizer, moe)
        _train(model, optimizer, SAVE_AT)
        for name in (key, key + "-unguarded"):
            os.makedirs(os.path.join(ckpt_dir, name), exist_ok=True)  # Megatron-LM makes it too
        dist.barrier()
        dist_checkpointing.save(_sharded(model, optimizer), os.path.join(ckpt_dir, key))
        results[key]["saved"] = optimizer.guard.stats().to_dict()
        if not distributed_optimizer:
            # The per-rank format (torch.save of state_dict()), beside it.
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(ckpt_dir, "legacy-rank%d.pt" % rank))
        # The same job's checkpoint as Megatron writes it unguarded.
        model_sd = model.module.sharded_state_dict()
        dist_checkpointing.save(
            {"model": model_sd,
             "optimizer": optimizer._megatron.sharded_state_dict(model_sd, is_loading=False,
                                                                  metadata=METADATA)},
            os.path.join(ckpt_dir, key + "-unguarded"))
    _finish(out_dir, rank, results)


def _load_main(rank, world, port, out_dir, ckpt_dir, moe):
    _init(rank, world, port, moe)
    results = {}
    for distributed_optimizer in CONFIGS:
        key = "distopt" if distributed_optimizer else "ddp"
        model, optimizer = _guarded(distributed_optimizer, moe)
        _load(model, optimizer, os.path.join(ckpt_dir, key), distributed_optimizer)
        loaded = optimizer.guard.stats().to_dict()
        results[key] = {"loaded": loaded, "resumed": _train(model, optimizer, STEPS)}
        model, optimizer = _guarded(distributed_optimizer, moe)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _load(model, optimizer, os.path.join(ckpt_dir, key + "-unguarded"),
                  distributed_optimizer)
        results[key]["unguarded_warnings"] = [str(w.message) for w in caught
                                              if "stepguard" in str(w.message)]
        results[key]["unguarded_step_count"] = optimizer.guard.stats().step_count
        results[key]["unguarded_steps"] = _train(model, optimizer, 2)
        if not distributed_optimizer:
            model, optimizer = _guarded(distributed_optimizer, moe)
            legacy = torch.load(os.path.join(ckpt_dir, "legacy-rank%d.pt" % rank),
                                weights_only=False)
            model.load_state_dict(legacy["model"])
            optimizer.load_state_dict(legacy["optimizer"])
            results[key]["legacy"] = _train(model, optimizer, STEPS)
    _finish(out_dir, rank, results)


def _init(rank, world, port, moe):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron_cpu
    megatron_cpu.install()
    from megatron.core import parallel_state
    if moe:  # expert parallel on the 2 ranks (te_general_gemm: test_megatron_moe.py's shim)
        from megatron.core.transformer.moe import moe_utils
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    else:
        parallel_state.initialize_model_parallel(2, 1)  # tensor parallel on the 2 ranks


def _finish(out_dir, rank, results):
    from megatron.core import parallel_state

    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f, default=str)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("moe", [False, True], ids=["tp2", "moe-ep2"])
def test_dist_checkpointing_carries_the_guard_and_resumes_bitwise(moe):
    with tempfile.TemporaryDirectory() as ckpt_dir:
        saved = spawn_ranks(_save_main, 2, ckpt_dir, moe, timeout=300)
        loaded = spawn_ranks(_load_main, 2, ckpt_dir, moe, timeout=300)
    for rank in range(2):
        for key in ("ddp", "distopt"):
            whole = {int(k): v for k, v in saved[rank][key]["whole"].items()}
            assert whole[NAN_GRAD][0] == "skipped" and whole[SPIKE][0] == "rolled_back", whole
            assert whole[SAVE_AT][2] == 0.5  # the spike lowered the LR factor
            before, after = saved[rank][key]["saved"], loaded[rank][key]["loaded"]
            for field in ("step_count", "totals", "lr_factor", "data_position",
                          "skipped_ranges", "bad_steps_total"):
                assert after[field] == before[field], (key, field, before, after)
            resumed = {int(k): v for k, v in loaded[rank][key]["resumed"].items()}
            assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1)), resumed
            for step, value in resumed.items():
                assert value == whole[step], (key, rank, step, value, whole[step])
            # Saved without the guard: Megatron's part loads, the guard starts fresh, said once.
            assert loaded[rank][key]["unguarded_step_count"] == 0
            assert len(loaded[rank][key]["unguarded_warnings"]) == 1, loaded[rank][key]
            assert "the guard starts fresh" in loaded[rank][key]["unguarded_warnings"][0]
            if key == "ddp":
                legacy = {int(k): v for k, v in loaded[rank][key]["legacy"].items()}
                assert legacy == {s: whole[s] for s in resumed}, (rank, legacy)
            steps = loaded[rank][key]["unguarded_steps"]
            assert [v[0] for v in steps.values()] == ["applied", "applied"], steps

"""stepguard inside the real Megatron-core with mixture-of-experts layers, on CPU with Gloo (the
CUDA calls Megatron makes mapped to the CPU by megatron_cpu.py): a GPTModel of 2 layers whose MLP
is a MoE layer of 4 experts (top-2 router with its auxiliary loss, the ``allgather`` token
dispatcher: ``alltoall`` makes a CUDA stream), bf16, with and without the distributed optimizer.
``get_megatron_optimizer`` builds a ChainedOptimizer of the dense and the expert parameters'
optimizers; the guard steps both as one step with one norm, as Megatron does.

Layouts: expert parallel EP=2 on 2 ranks (each rank its own 2 experts, the dense parameters
data-parallel replicas); EP=2 x DP=2 on 4 ranks (each expert on 2 ranks: expert data parallel).
Faults: a NaN in one expert's gradient on one rank (step 3), a NaN loss on one rank (step 5), a
loss spike on every rank (step 8). Checked on every rank: the guard's norm is Megatron's own
(``ChainedOptimizer.get_grad_norm()`` on the same main gradients) within 1e-6 on every applied
step; the faults skipped everywhere, the expert's tensor and the rank named; the spike rolled
back bitwise (model and main parameters, both optimizers' state); the replicas of every
parameter equal; on a clean step the integration adds no collective: the guard's one, and
Megatron's own update. Megatron also calls ``grad_scale_func`` on ``torch.ones(1)`` for the
auxiliary loss's scale; the guard's loss is the model's loss alone (checked against the loss the
schedule reports).

Test-only shim besides megatron_cpu.py: megatron-core 0.16.1's ``moe_utils`` defines
``te_general_gemm`` only when Transformer Engine is installed, and its router reads the name;
set to None it selects Megatron's own torch path."""

import os

import pytest
import torch
import torch.distributed as dist

import megatron.core  # noqa: F401  (a missing Megatron-core fails the test)
from conftest import POLICY, spawn_ranks
from test_megatron import MICRO, _batches, _forward_step
from test_megatron_parallel import _count_collectives, _flat, _optimizer_state

STEPS, NAN_EXPERT, NAN_LOSS, SPIKE = 10, 3, 5, 8
EXPERTS = 4
EXPERT = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
CONFIGS = (False, True)  # the distributed optimizer


def _build(ep, distributed_optimizer, fp16=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    dtype = torch.float16 if fp16 else torch.bfloat16
    config = TransformerConfig(num_layers=2, hidden_size=16, ffn_hidden_size=32,
                               num_attention_heads=2, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bf16=not fp16,
                               fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype,
                               num_moe_experts=EXPERTS, expert_model_parallel_size=ep,
                               moe_router_topk=2, moe_aux_loss_coeff=0.01,
                               moe_token_dispatcher_type="allgather")
    module = GPTModel(config=config, vocab_size=64, max_sequence_length=16,
                      transformer_layer_spec=get_gpt_layer_local_spec(
                          num_experts=EXPERTS, moe_grouped_gemm=False)).to(dtype)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    chunk = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=not fp16, fp16=fp16,
                                       clip_grad=1.0,
                                       use_distributed_optimizer=distributed_optimizer)
    return [chunk], config, get_megatron_optimizer(optimizer_config, [chunk])


def _state(inners):
    return torch.cat([_optimizer_state(inner) for inner in inners])


def _equal_in(group, flat):
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, flat, group=group)
    return all(torch.equal(flat, c) for c in copies)


def _run(ep, distributed_optimizer):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    chunks, config, megatron_optimizer = _build(ep, distributed_optimizer)
    assert [type(o).__name__ for o in megatron_optimizer.chained_optimizers].count(
        type(megatron_optimizer.chained_optimizers[0]).__name__) == 2
    optimizer = GuardedMegatronOptimizer(megatron_optimizer, chunks, policy=POLICY,
                                         collective_timeout=60)
    config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's training.py does
    inners = optimizer._inners
    megatron_norms = []
    real_prepare = megatron_optimizer.prepare_grads

    def prepare_and_measure():
        found = real_prepare()
        megatron_norms.append(megatron_optimizer.get_grad_norm())  # Megatron's chained norm
        return found
    megatron_optimizer.prepare_grads = prepare_and_measure
    dp_rank, ep_rank = ps.get_data_parallel_rank(), ps.get_expert_model_parallel_rank()
    module = chunks[0].module
    named = dict(module.named_parameters())
    dense = [p for p in module.parameters() if getattr(p, "allreduce", True)]
    experts = [p for p in module.parameters() if not getattr(p, "allreduce", True)]
    main_params = [p for inner in inners for g in inner.optimizer.param_groups
                   for p in g["params"]]
    steps, after = [], {}
    position, counts = 0, None
    for step in range(1, STEPS + 2):
        batches = _batches(position, dp_rank)
        position += MICRO
        factor = 1.0
        if step == NAN_LOSS and dist.get_rank() == 0:
            factor = float("nan")
        if step == SPIKE:
            factor = 300.0
        losses = []
        forward_step = _forward_step(factor, losses)

        hooks = []
        if step == NAN_EXPERT and dist.get_rank() == 1:
            hooks.append(named[EXPERT].register_hook(lambda grad: grad * float("nan")))
        chunks[0].zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches),
                                    model=chunks, num_microbatches=MICRO, seq_length=8,
                                    micro_batch_size=2, forward_only=False)
        for h in hooks:
            h.remove()
        if step == STEPS + 1:
            # A clean step, measured: the guard's one collective, nothing else of the integration.
            megatron_optimizer.prepare_grads = real_prepare
            before = optimizer.guard.stats().collective_calls
            counts, restore = _count_collectives(megatron_optimizer, inners[0])
            try:
                optimizer.step()
            finally:
                restore()
            counts["guard"] = optimizer.guard.stats().collective_calls - before
            counts["applied"] = optimizer.last_report.applied
            break
        success, grad_norm, _ = optimizer.step()
        report = optimizer.last_report
        position += report.batches_to_skip
        model_flat = _flat(list(module.parameters()))
        after[report.step] = (model_flat, _flat(main_params), _state(inners))
        restored = None
        if report.rolled_back:
            then = after[report.rolled_back_to]
            restored = all(torch.equal(a, b) for a, b in zip(after[report.step], then))
        steps.append({
            "step": report.step, "outcome": report.outcome, "grad_norm": report.grad_norm,
            "megatron_norm": float(megatron_norms[-1]), "returned": [success, grad_norm],
            "loss": report.loss, "schedule_loss": float(sum(losses)) if losses else None,
            "incident": report.incident, "restored": restored,
            "dense_equal": _equal_in(ps.get_data_parallel_group(), _flat(dense)),
            "experts_equal": _equal_in(ps.get_expert_data_parallel_group(), _flat(experts)),
            "finite": bool(torch.isfinite(model_flat).all()),
        })
    return {"steps": steps, "counts": counts, "ep_rank": ep_rank}


def _fp16_refusal(ep):
    """fp16 with MoE (each chained optimizer with its own grad scaler): refused on every rank,
    from the config."""
    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    chunks, _, megatron_optimizer = _build(ep, False, fp16=True)
    try:
        GuardedMegatronOptimizer(megatron_optimizer, chunks, policy=POLICY)
    except ValueError as e:
        return str(e)
    return None


def _rank_main(rank, world, port, out_dir, layouts):
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron_cpu
    megatron_cpu.install()
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # the test-only shim: Megatron's torch path
    from megatron.core import parallel_state
    results = {}
    for ep in layouts:
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
        for distributed_optimizer in CONFIGS:
            results["ep%d-%s" % (ep, distributed_optimizer)] = _run(ep, distributed_optimizer)
        results["fp16_refused"] = _fp16_refusal(ep)
        parallel_state.destroy_model_parallel()
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f, default=str)
    dist.destroy_process_group()


def _check(ranks, key):
    world = len(ranks)
    for rank, result in enumerate(ranks):
        run = result[key]
        steps = {s["step"]: s for s in run["steps"]}
        assert len(run["steps"]) == STEPS, (key, rank, run["steps"])
        for s in run["steps"]:
            assert s["dense_equal"] and s["experts_equal"] and s["finite"], (key, rank, s)
            if s["outcome"] == "applied":
                # One norm over the dense and the expert parameters, every element once.
                assert s["grad_norm"] == pytest.approx(s["megatron_norm"], rel=1e-6), (key, rank, s)
                assert s["returned"] == [True, s["grad_norm"]], (key, rank, s)
                # The model's loss alone (not the auxiliary loss's scale calls): each rank's
                # micro-batch losses over the micro-batch count, summed, mean over ranks.
                losses = [r[key]["steps"][s["step"] - 1]["schedule_loss"] for r in ranks]
                assert s["loss"] == pytest.approx(sum(losses) / world / MICRO, rel=1e-6), (
                    key, rank, s)
            else:
                assert s["returned"] == [False, None], (key, rank, s)
        expert = steps[NAN_EXPERT]
        assert expert["outcome"] == "skipped", (key, rank, expert)
        assert expert["incident"]["tensors"] == [EXPERT], (key, rank, expert["incident"])
        assert steps[NAN_LOSS]["outcome"] == "skipped", (key, rank, steps[NAN_LOSS])
        assert steps[NAN_LOSS]["incident"]["ranks"] == [0], steps[NAN_LOSS]["incident"]
        assert steps[SPIKE]["outcome"] == "rolled_back" and steps[SPIKE]["restored"], (
            key, rank, steps[SPIKE])
        counts = run["counts"]
        assert counts["applied"] and counts["guard"] == 1 and counts["outside"] == 0, (
            key, rank, counts)
    # The expert's NaN, named alike on every rank: rank 1's own expert, averaged into its
    # expert data-parallel replicas (the ranks of the same expert-parallel rank): all of them,
    # or under the distributed optimizer the ones whose shard holds it (no rank-local evidence
    # tells them apart).
    named = [ranks[r][key]["steps"][NAN_EXPERT - 1]["incident"]["ranks"] for r in range(world)]
    assert all(n == named[0] for n in named), (key, named)
    holders = [r for r in range(world) if ranks[r][key]["ep_rank"] == ranks[1][key]["ep_rank"]]
    assert named[0] and set(named[0]) <= set(holders), (key, named[0], holders)
    if key.endswith("False"):
        assert named[0] == holders, (key, named[0], holders)


def test_moe_expert_parallel_on_two_ranks():
    ranks = spawn_ranks(_rank_main, 2, [2], timeout=400)
    for distributed_optimizer in CONFIGS:
        _check(ranks, "ep2-%s" % distributed_optimizer)
    assert all("fp16 with MoE" in (r["fp16_refused"] or "") for r in ranks), ranks[0]


def test_moe_expert_parallel_with_expert_data_parallel_on_four_ranks():
    ranks = spawn_ranks(_rank_main, 4, [2], timeout=400)
    for distributed_optimizer in CONFIGS:
        _check(ranks, "ep2-%s" % distributed_optimizer)

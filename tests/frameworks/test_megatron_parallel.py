"""stepguard inside the real Megatron-core under model parallelism, on CPU with Gloo (the CUDA calls
Megatron makes mapped to the CPU by megatron_cpu.py): a GPTModel split by tensor parallelism
(TP=2), pipeline parallelism (PP=2, one layer per stage; the word embedding tied to the output
layer across the stages, Megatron-LM's default) and both with data parallelism, on 2 and 4 ranks,
bf16 with and without the distributed optimizer, steps driven by get_forward_backward_func with 2
micro-batches (the 1F1B schedule under PP, the interleaved one with 2 model chunks a rank).

Layouts: TP=2, TP=2 with sequence parallelism, PP=2, PP=2 interleaved (4 layers, 2 virtual
stages), DP=2 with overlap_grad_reduce (and overlap_param_gather under the distributed optimizer)
on 2 ranks; TP=2 x DP=2 (with and without sequence parallelism), TP=2 x PP=2 and PP=4 on 4 ranks.
Sequence parallelism takes a test-only norm (SequenceParallelLayerNorm: megatron-core's torch norm
refuses it, apex and Transformer Engine do not install here). Faults: a NaN
gradient of a tensor-parallel shard on one TP rank (step 3), a NaN gradient of a layernorm every
TP rank holds, on one rank of the last stage (step 4), a NaN loss on one rank of the last stage
(step 5), a loss spike on every rank (step 8). Checked on every rank: the guard's grad norm is
Megatron's own (``get_grad_norm()`` on the same main gradients) within 1e-6 on every applied step;
the faults are skipped everywhere with the tensor and the rank named; the spike is rolled back
bitwise (model and main parameters, optimizer state); data-parallel replicas stay equal; step()
returns Megatron's tuple; and on a clean step the integration adds no collective of its own: the
guard's one, and Megatron's own zero count and update."""

import os

import pytest
import torch
import torch.distributed as dist

import megatron.core  # noqa: F401  (a missing Megatron-core fails the test)
from conftest import POLICY, spawn_ranks
from test_megatron import MICRO, _batches, _forward_step

STEPS, NAN_SHARD, NAN_COPY, NAN_LOSS, SPIKE = 10, 3, 4, 5, 8
SHARD = "decoder.layers.0.mlp.linear_fc1.weight"  # column-parallel: split over the TP ranks
COPY = "decoder.final_layernorm.weight"           # on the last stage, a copy on every TP rank
CONFIGS = [("bf16", False), ("bf16", True)]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "barrier",
               "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "batch_isend_irecv")


def _build(tp, pp, vpp, distributed_optimizer, extra=""):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=max(2, pp) * vpp, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
                               pipeline_dtype=torch.bfloat16, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, sequence_parallel=extra == "sp",
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    spec = _sequence_parallel_spec(config) if extra == "sp" else get_gpt_layer_local_spec()
    overlap = extra == "overlap"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and distributed_optimizer,
        use_distributed_optimizer=distributed_optimizer)
    chunks = []
    for i in range(vpp):
        vp = i if vpp > 1 else None
        module = GPTModel(config=config, transformer_layer_spec=spec,
                          vocab_size=64, max_sequence_length=16, vp_stage=vp,
                          share_embeddings_and_output_weights=True,  # Megatron-LM's default
                          pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                          post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
                          ).to(torch.bfloat16)
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                              disable_bucketing=i > 0))
    config.finalize_model_grads_func = finalize_model_grads
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                                       log_num_zeros_in_grad=True,
                                       use_distributed_optimizer=distributed_optimizer)
    return chunks, config, get_megatron_optimizer(optimizer_config, chunks)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """Test-only: torch's LayerNorm as Megatron's fused (apex) and Transformer Engine norms are
    under sequence parallelism: its parameters marked ``sequence_parallel``, so that Megatron's
    finalize_model_grads all-reduces their gradients over the tensor-parallel group (each rank's
    holds only its part of the sequence). megatron-core's own torch norm refuses sequence
    parallelism, and neither apex nor Transformer Engine installs here."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def _sequence_parallel_spec(config):
    """Megatron's local GPT layer spec with SequenceParallelLayerNorm for its norms (the layers'
    and the final one)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)
    layer = get_gpt_layer_local_spec()
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=SequenceParallelLayerNorm,
        pre_mlp_layernorm=SequenceParallelLayerNorm))
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelLayerNorm)


def _flat(tensors):
    return torch.cat([t.detach().float().reshape(-1) for t in tensors]) if tensors else \
        torch.zeros(0)


def _optimizer_state(inner):
    out = []
    for group in inner.optimizer.param_groups:
        for p in group["params"]:
            for key, value in sorted(inner.optimizer.state.get(p, {}).items()):
                if torch.is_tensor(value):
                    out.append(value)
    return _flat(out)


def _count_collectives(megatron_optimizer, inner):
    """Counts the torch.distributed calls made outside Megatron's own zero count and update."""
    counts = {"outside": 0}
    depth = [0]
    undo = []
    for name in COLLECTIVES:
        real = getattr(dist, name, None)
        if real is None:
            continue

        def counted(*args, _real=real, **kwargs):
            if depth[0] == 0:
                counts["outside"] += 1
            return _real(*args, **kwargs)
        setattr(dist, name, counted)
        undo.append((dist, name, real))
    for owner, name in ((inner, "count_zeros"), (megatron_optimizer, "step_with_ready_grads")):
        real = getattr(owner, name)

        def inside(*args, _real=real, **kwargs):
            depth[0] += 1
            try:
                return _real(*args, **kwargs)
            finally:
                depth[0] -= 1
        setattr(owner, name, inside)
        undo.append((owner, name, None))

    def restore():
        for owner, name, real in undo:
            if real is None:
                delattr(owner, name)
            else:
                setattr(owner, name, real)
    return counts, restore


def _run(rank, tp, pp, vpp, distributed_optimizer, extra=""):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    chunks, config, megatron_optimizer = _build(tp, pp, vpp, distributed_optimizer, extra)
    optimizer = GuardedMegatronOptimizer(megatron_optimizer, chunks, policy=POLICY,
                                         collective_timeout=60)
    config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's training.py does
    inner = optimizer._inner
    # Megatron's own norm of the main gradients the guard inspects, measured right after
    # prepare_grads() on every rank (an extra collective of the test's, not of the guard's).
    megatron_norms = []
    real_prepare = optimizer._megatron.prepare_grads

    def prepare_and_measure():
        found = real_prepare()
        megatron_norms.append(inner.get_grad_norm())
        return found
    optimizer._megatron.prepare_grads = prepare_and_measure
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    shard_param = dict(chunks[0].module.named_parameters())[SHARD]
    copy_param = dict(chunks[-1].module.named_parameters()).get(COPY)  # the last stage's
    main_params = [p for g in inner.optimizer.param_groups for p in g["params"]]
    steps, after = [], {}
    position = 0
    counts = None
    for step in range(1, STEPS + 2):
        batches = _batches(position, dp_rank)
        position += MICRO
        factor = 1.0
        if step == NAN_LOSS and last and tp_rank == 0 and dp_rank == 0:
            factor = float("nan")
        if step == SPIKE:
            factor = 300.0
        forward_step = _forward_step(factor)

        hooks = []
        if step == NAN_SHARD and first and tp_rank == tp - 1 and dp_rank == 0:
            hooks.append(shard_param.register_hook(lambda grad: grad * float("nan")))
        if step == NAN_COPY and last and tp_rank == tp - 1 and dp_rank == 0:
            hooks.append(copy_param.register_hook(lambda grad: grad * float("nan")))
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        # The interleaved schedule takes one iterator per model chunk.
        data = [iter(batches) for _ in chunks] if vpp > 1 else iter(batches)
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data,
                                    model=chunks, num_microbatches=MICRO, seq_length=8,
                                    micro_batch_size=2, forward_only=False)
        for h in hooks:
            h.remove()
        if step == STEPS + 1:
            # A clean step, measured: the guard's one collective, nothing else of the integration.
            optimizer._megatron.prepare_grads = real_prepare
            before = optimizer.guard.stats().collective_calls
            counts, restore = _count_collectives(optimizer._megatron, inner)
            try:
                returned = optimizer.step()
            finally:
                restore()
            counts["guard"] = optimizer.guard.stats().collective_calls - before
            counts["applied"] = optimizer.last_report.applied
            counts["returned_norm"] = returned[1] == optimizer.last_report.grad_norm
            break
        success, grad_norm, zeros = optimizer.step()
        report = optimizer.last_report
        position += report.batches_to_skip
        if extra == "overlap" and distributed_optimizer:
            # overlap_param_gather: the updated shards reach the other ranks during the next
            # forward; gathered now (Megatron's own forced sync) to be measured.
            for chunk in chunks:
                chunk.start_param_sync(force_sync=True)
        model_flat = _flat([p for c in chunks for p in c.module.parameters()])
        main_flat = _flat(main_params)
        state = _optimizer_state(inner)
        after[report.step] = (model_flat, main_flat, state)
        replicas = [torch.empty_like(model_flat) for _ in range(ps.get_data_parallel_world_size())]
        dist.all_gather(replicas, model_flat, group=ps.get_data_parallel_group())
        restored = None
        if report.rolled_back:
            then = after[report.rolled_back_to]
            restored = (torch.equal(model_flat, then[0]) and torch.equal(main_flat, then[1])
                        and torch.equal(state, then[2]))
        steps.append({
            "step": report.step, "outcome": report.outcome, "grad_norm": report.grad_norm,
            "megatron_norm": float(megatron_norms[-1]), "returned": [success, grad_norm, zeros],
            "incident": report.incident, "restored": restored,
            "replicas_equal": all(torch.equal(model_flat, r) for r in replicas),
            "finite": bool(torch.isfinite(model_flat).all()),
        })
    return {"steps": steps, "counts": counts, "tp_rank": tp_rank,
            "stage": ps.get_pipeline_model_parallel_rank(), "dp_rank": dp_rank}


def _rank_main(rank, world, port, out_dir, layouts):
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron_cpu
    megatron_cpu.install()
    from megatron.core import parallel_state
    results = {}
    for tp, pp, vpp, extra in layouts:
        parallel_state.initialize_model_parallel(
            tp, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        for precision, distributed_optimizer in CONFIGS:
            results[_key(tp, pp, vpp, precision, distributed_optimizer, extra)] = _run(
                rank, tp, pp, vpp, distributed_optimizer, extra)
        parallel_state.destroy_model_parallel()
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f, default=str)
    # No destroy_process_group(): the rank leaves at once (spawn_ranks), and tearing the Gloo
    # groups down in-process crashed a rank once in CI (SIGSEGV after every run had printed).


def _key(tp, pp, vpp, precision, distributed_optimizer, extra=""):
    return "tp%d-pp%d-vpp%d-%s-%s%s" % (tp, pp, vpp, precision,
                                        "distopt" if distributed_optimizer else "ddp",
                                        "-" + extra if extra else "")


def _check(ranks, key, tp, pp, vpp):
    world = len(ranks)
    for rank, result in enumerate(ranks):
        run = result[key]
        steps = {s["step"]: s for s in run["steps"]}
        assert len(run["steps"]) == STEPS, (key, rank, run["steps"])
        for s in run["steps"]:
            assert s["replicas_equal"] and s["finite"], (key, rank, s)
            if s["outcome"] == "applied":
                # The guard's norm is Megatron's own, every element counted once.
                assert s["grad_norm"] == pytest.approx(s["megatron_norm"], rel=1e-6), (key, rank, s)
                success, grad_norm, zeros = s["returned"]
                assert success is True and zeros is not None and grad_norm == s["grad_norm"], \
                    (key, rank, s)
            else:
                assert s["returned"] == [False, None, None], (key, rank, s)
        # Several chunks: named by chunk, as Megatron-LM's checkpoints name them.
        names = (("model0." + SHARD, "model%d." % (vpp - 1) + COPY) if vpp > 1 else (SHARD, COPY))
        for step, tensor in ((NAN_SHARD, names[0]), (NAN_COPY, names[1])):
            incident = steps[step]["incident"]
            assert steps[step]["outcome"] == "skipped", (key, rank, steps[step])
            assert tensor in incident["tensors"], (key, rank, incident)
        assert steps[NAN_LOSS]["outcome"] == "skipped", (key, rank, steps[NAN_LOSS])
        assert steps[SPIKE]["outcome"] == "rolled_back", (key, rank, steps[SPIKE])
        assert steps[SPIKE]["restored"], (key, rank, steps[SPIKE])
        counts = run["counts"]
        assert counts["applied"] and counts["returned_norm"], (key, rank, counts)
        assert counts["guard"] == 1 and counts["outside"] == 0, (key, rank, counts)
    # The ranks named are where the fault was put, the same on every rank: a NaN gradient
    # reaches the data-parallel replicas of its rank through the gradient average (all of them,
    # or under the distributed optimizer the ones whose shard holds it: no rank-local evidence
    # tells them apart); a NaN loss is the one rank's own.
    def ranks_at(tp_rank, stage, dp_rank=None):
        return [r for r, res in enumerate(ranks)
                if (res[key]["tp_rank"], res[key]["stage"]) == (tp_rank, stage)
                and dp_rank in (None, res[key]["dp_rank"])]
    # Under sequence parallelism the layernorm's gradient is summed over the tensor-parallel
    # group (finalize_model_grads) before the guard reads it: every TP rank of the last stage
    # holds the NaN, and no rank-local evidence says which made it.
    copy_from = ranks_at(tp - 1, pp - 1)
    if key.endswith("-sp"):
        copy_from = sorted(set(copy_from) | set(ranks_at(0, pp - 1)))
    for step, where in ((NAN_SHARD, ranks_at(tp - 1, 0)), (NAN_COPY, copy_from),
                        (NAN_LOSS, ranks_at(0, pp - 1, 0))):
        named = [ranks[r][key]["steps"][step - 1]["incident"]["ranks"] for r in range(world)]
        assert all(n == named[0] for n in named), (key, step, named)
        assert named[0] and set(named[0]) <= set(where), (key, step, named[0], where)
        if step == NAN_LOSS or "-ddp" in key:
            assert named[0] == where, (key, step, named[0], where)


def _launch_and_check(world, layouts):
    ranks = spawn_ranks(_rank_main, world, layouts, timeout=400)
    for tp, pp, vpp, extra in layouts:
        for precision, distributed_optimizer in CONFIGS:
            _check(ranks, _key(tp, pp, vpp, precision, distributed_optimizer, extra), tp, pp, vpp)


def test_tensor_and_pipeline_parallel_on_two_ranks():
    # (TP, PP, virtual stages, option): PP=2 under the interleaved schedule (2 chunks a rank);
    # DP=2 with overlap_grad_reduce (and, with the distributed optimizer, overlap_param_gather).
    _launch_and_check(2, [(2, 1, 1, ""), (2, 1, 1, "sp"), (1, 2, 1, ""), (1, 2, 2, ""),
                          (1, 1, 1, "overlap")])


def test_tensor_parallel_with_data_or_pipeline_parallel_on_four_ranks():
    # TP=2 x DP=2, TP=2 x PP=2, and PP=4 (one layer a stage).
    _launch_and_check(4, [(2, 1, 1, ""), (2, 1, 1, "sp"), (2, 2, 1, ""), (1, 4, 1, "")])


TWIN_STEPS = 4


def _twin_rank_main(rank, world, port, out_dir):
    """TP=2, bf16, Megatron's clip_grad=1.0 binding on every step: Megatron's own step against
    the guarded one with framework_norm=True, 4 clean steps each from the same start."""
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron_cpu
    megatron_cpu.install()
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    ps.initialize_model_parallel(2, 1)
    results = {}
    for name in ("twin", "framework_norm"):
        chunks, config, megatron_optimizer = _build(2, 1, 1, False)
        optimizer = megatron_optimizer
        if name == "framework_norm":
            optimizer = GuardedMegatronOptimizer(megatron_optimizer, chunks, policy=POLICY,
                                                 framework_norm=True, collective_timeout=60)
            config.grad_scale_func = optimizer.scale_loss
        norms = []
        for step in range(TWIN_STEPS):
            chunks[0].zero_grad_buffer()
            optimizer.zero_grad()
            get_forward_backward_func()(forward_step_func=_forward_step(1.0),
                                        data_iterator=iter(_batches(step * MICRO, 0)),
                                        model=chunks, num_microbatches=MICRO, seq_length=8,
                                        micro_batch_size=2, forward_only=False)
            success, grad_norm, _ = optimizer.step()
            norms.append(float(grad_norm))
        results[name] = {"params": _flat(list(chunks[0].module.parameters())).tolist(),
                         "norms": norms}
    ps.destroy_model_parallel()
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f)
    # No destroy_process_group(): as in _rank_main.


def test_framework_norm_is_megatrons_own_step_bitwise_under_tensor_parallelism():
    ranks = spawn_ranks(_twin_rank_main, 2, timeout=300)
    for rank, r in enumerate(ranks):
        assert min(r["twin"]["norms"]) > 1.0, r["twin"]["norms"]  # clip_grad=1.0 binds
        assert r["framework_norm"]["norms"] == r["twin"]["norms"], rank
        assert r["framework_norm"]["params"] == r["twin"]["params"], rank

"""stepguard inside the real Megatron-core in fp16 (``Float16OptimizerWithFloat16Params`` and the
distributed optimizer, Megatron's ``DynamicGradScaler`` with hysteresis 2), on CPU with Gloo
(megatron_cpu.py maps Megatron's CUDA calls), beside an unguarded twin that steps Megatron's
optimizer itself on the same data and faults. Layouts: data parallel on 2 ranks (with and
without the distributed optimizer) and TP=2 on 2 ranks.

The initial loss scale is far too high (2^22 for a model whose fp16 gradients overflow above
~2^19): the first steps overflow and Megatron's scaler backs off, by its hysteresis. Then a NaN
loss on the last rank, and a loss whose value spikes on every rank (its gradient as usual: a
300 times larger fp16 gradient would be one more overflow, the scaler's). Checked on every rank:
the guard's steps skip exactly where the twin's Megatron skipped, with the same scale after
every step and the same parameters bit for bit up to the spike; every step of the streak is an
``overflow`` / ``precision_overflow``; the NaN loss is skipped with its rank named; the spike is
rolled back bit for bit (model and main parameters); step() returns Megatron's tuple and the
guard's norm is Megatron's own; replicas stay equal."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import megatron.core  # noqa: F401  (a missing Megatron-core fails the test)
from conftest import POLICY, spawn_ranks

STEPS, NAN_LOSS, SPIKE = 16, 11, 14
MICRO = 2
INITIAL_SCALE, WINDOW, HYSTERESIS = 2.0 ** 22, 3, 2


def _build(tp, distributed_optimizer):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, fp16=True, params_dtype=torch.float16,
                               pipeline_dtype=torch.float16, tensor_model_parallel_size=tp)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=64, max_sequence_length=16).to(torch.float16)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    # A clip that never binds: Megatron computes and returns its own norm (compared with the
    # guard's), and the updates do not depend on who computed it (the twin is compared bit for
    # bit; a binding clip differs in the last bits of its coefficient).
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-3, fp16=True, clip_grad=1e6,
                                       initial_loss_scale=INITIAL_SCALE, min_loss_scale=1.0,
                                       loss_scale_window=WINDOW, hysteresis=HYSTERESIS,
                                       use_distributed_optimizer=distributed_optimizer)
    return model, config, get_megatron_optimizer(optimizer_config, [model])


@contextlib.contextmanager
def _host_reads():
    """The Python-level reads of a tensor to the host inside the block (item(), float())."""
    reads, real = [], {name: getattr(torch.Tensor, name) for name in ("item", "__float__")}
    for name, f in real.items():
        setattr(torch.Tensor, name, lambda self, _f=f, _n=name: reads.append(_n) or _f(self))
    try:
        yield reads
    finally:
        for name, f in real.items():
            setattr(torch.Tensor, name, f)


def _run(rank, world, tp, distributed_optimizer, guarded):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    model, config, megatron_optimizer = _build(tp, distributed_optimizer)
    inner = megatron_optimizer.chained_optimizers[0] if hasattr(
        megatron_optimizer, "chained_optimizers") else megatron_optimizer
    optimizer = megatron_optimizer
    if guarded:
        optimizer = GuardedMegatronOptimizer(megatron_optimizer, model, policy=POLICY,
                                             collective_timeout=60)
    config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's training.py does
    main_params = [p for g in inner.optimizer.param_groups for p in g["params"]]
    steps = []
    for step in range(1, STEPS + 1):
        batches = []
        for micro in range(MICRO):  # the same data on the TP ranks of a replica
            g = torch.Generator().manual_seed(100 * (MICRO * step + micro) + rank // tp)
            batches.append(torch.randint(0, 64, (2, 8), generator=g))
        nan = step == NAN_LOSS and rank == world - 1

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            positions = torch.arange(batch.shape[1]).unsqueeze(0).expand_as(batch)
            output = model(batch, positions, None, labels=batch)

            def loss_func(output):
                loss = output.float().mean()
                if nan:
                    loss = loss * float("nan")
                if step == SPIKE:
                    loss = loss + 300.0 * loss.detach()
                return loss, {"loss": loss.detach().clone()}
            return output, loss_func

        scale_before = float(inner.grad_scaler.scale)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches),
                                    model=[model], num_microbatches=MICRO, seq_length=8,
                                    micro_batch_size=2, forward_only=False)
        with _host_reads() as reads:  # item() and float() of tensors, from Python
            success, grad_norm, zeros = optimizer.step()
        flat = torch.cat([p.detach().float().reshape(-1) for p in model.module.parameters()])
        main = torch.cat([p.detach().reshape(-1) for p in main_params])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        row = {"success": success, "grad_norm": grad_norm, "scale_before": scale_before,
               "reads": len(reads),
               "scale": float(inner.grad_scaler.scale), "flat": flat.tolist(),
               "main": main.tolist(),
               "replicas_equal": all(torch.equal(flat, t) for t in gathered[rank % tp::tp])}
        if guarded:
            report = optimizer.last_report
            row.update(outcome=report.outcome, report_norm=report.grad_norm,
                       loss_scale=report.loss_scale, rolled_back_to=report.rolled_back_to,
                       incident=report.incident and {k: report.incident.get(k) for k in (
                           "signal", "cause", "ranks", "action")})
        steps.append(row)
    return {"steps": steps, "optimizer": type(inner).__name__}


def _rank_main(rank, world, port, out_dir, tp, layouts):
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron_cpu
    megatron_cpu.install()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tp, 1)
    results = {}
    for distributed_optimizer in layouts:
        for guarded in (True, False):
            key = "%s-%s" % ("distopt" if distributed_optimizer else "ddp",
                             "guarded" if guarded else "twin")
            results[key] = _run(rank, world, tp, distributed_optimizer, guarded)
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _check(ranks, layout):
    for rank, result in enumerate(ranks):
        guarded, twin = result[layout + "-guarded"]["steps"], result[layout + "-twin"]["steps"]
        assert result[layout + "-guarded"]["optimizer"] in (
            "Float16OptimizerWithFloat16Params", "DistributedOptimizer")
        skipped = [i + 1 for i, s in enumerate(twin) if not s["success"]]
        streak = next(i for i in range(1, STEPS + 1) if i not in skipped) - 1
        # The schedule the test needs: a streak first, long enough to need the hysteresis, the
        # NaN loss a skip of Megatron's, the value spike not, the scale growing in between.
        assert streak >= 4 and NAN_LOSS in skipped and SPIKE not in skipped, skipped
        # Hysteresis 2: the first overflow leaves the scale, the second halves it.
        assert [s["scale"] for s in twin[:2]] == [INITIAL_SCALE, INITIAL_SCALE / 2], twin[:2]
        assert any(s["scale"] > s["scale_before"] for s in twin[:SPIKE - 1]), twin
        expected = ["skipped" if i + 1 in skipped else "applied" for i in range(SPIKE - 1)]
        assert [s["outcome"] for s in guarded[:SPIKE - 1]] == expected, (layout, rank)
        for i in range(SPIKE - 1):
            g, t = guarded[i], twin[i]
            assert (g["scale"], g["flat"], g["main"]) == (t["scale"], t["flat"], t["main"]), (
                layout, rank, i + 1)
            assert g["loss_scale"] == t["scale_before"], (layout, rank, i + 1)
            # The guard reads nothing from Python (its scale and floor ride in its step buffer):
            # a guarded step makes Megatron's own reads (its found-inf flag), less the norm's on
            # an applied step, which Megatron leaves to the guard.
            reads = (g["reads"], t["reads"])
            assert reads[0] < reads[1] if g["outcome"] == "applied" else reads[0] == reads[1], (
                layout, rank, i + 1, reads)
            if g["outcome"] == "applied":  # Megatron's tuple, its norm the guard's
                assert g["success"] is True and g["grad_norm"] == pytest.approx(
                    g["report_norm"], rel=1e-6), (layout, rank, i + 1)
                assert g["report_norm"] == pytest.approx(t["grad_norm"], rel=1e-6)
            else:
                assert (g["success"], g["grad_norm"]) == (False, None)
        for i in range(streak):
            assert guarded[i]["incident"]["signal"] == "overflow", guarded[i]
            assert guarded[i]["incident"]["cause"] == "precision_overflow", guarded[i]
        nan = guarded[NAN_LOSS - 1]["incident"]
        assert nan["signal"] == "nonfinite_loss" and nan["ranks"] == [len(ranks) - 1], nan
        spike = guarded[SPIKE - 1]
        assert spike["outcome"] == "rolled_back" and spike["incident"]["signal"] == "loss_spike"
        back = guarded[spike["rolled_back_to"] - 1]
        assert (spike["flat"], spike["main"]) == (back["flat"], back["main"]), (layout, rank)
        assert all(s["replicas_equal"] for s in guarded), (layout, rank)


def test_fp16_data_parallel_with_and_without_the_distributed_optimizer_beside_a_twin():
    ranks = spawn_ranks(_rank_main, 2, 1, [False, True])
    _check(ranks, "ddp")
    _check(ranks, "distopt")


def test_fp16_tensor_parallel_two_beside_a_twin():
    ranks = spawn_ranks(_rank_main, 2, 2, [False])
    _check(ranks, "ddp")

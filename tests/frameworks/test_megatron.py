"""stepguard inside the real Megatron-core on CPU with Gloo (the CUDA calls Megatron makes mapped to
the CPU by tests/frameworks/megatron_cpu.py): a small GPTModel in Megatron's DDP, the optimizer
from get_megatron_optimizer, steps driven by get_forward_backward_func; fp32 and bf16, with and
without the distributed optimizer, on 2 ranks (one configuration on 1 rank). Faults: a NaN
gradient of one parameter on the last rank (step 3), a NaN loss on that rank (step 5), a loss
spike on every rank (step 8)."""

import json
import os

import pytest
import torch
import torch.distributed as dist

import megatron.core  # noqa: F401  (a missing Megatron-core fails the test)
from conftest import POLICY, DataPositions, spawn_ranks

CONFIGS = [("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True)]
STEPS, NAN_GRAD, NAN_LOSS, SPIKE = 12, 3, 5, 8
MICRO = 2  # micro-batches per step (Megatron scales each loss by 1/MICRO)
TARGET = "decoder.layers.1.mlp.linear_fc2.weight"


def _batches(position, dp_rank):
    """The step's MICRO micro-batches of tokens, from data position ``position`` on."""
    out = []
    for i in range(MICRO):
        g = torch.Generator().manual_seed(100 * (position + i) + dp_rank)
        out.append(torch.randint(0, 64, (2, 8), generator=g))
    return out


def _forward_step(factor, losses=None):
    """Megatron's forward_step_func for a GPTModel: its loss times ``factor`` (NaN, a spike);
    each micro-batch's loss appended to ``losses`` when given."""
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        positions = torch.arange(batch.shape[1]).unsqueeze(0).expand_as(batch)
        output = model(batch, positions, None, labels=batch)

        def loss_func(output):
            loss = output.float().mean() * factor
            if losses is not None:
                losses.append(loss.detach().clone())
            # (a copy: Megatron divides the loss in place)
            return loss, {"loss": loss.detach().clone()}
        return output, loss_func
    return forward_step


def _build(precision, distributed_optimizer):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=bf16, params_dtype=dtype,
                               pipeline_dtype=dtype)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=64, max_sequence_length=16).to(dtype)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16, clip_grad=1.0,
                                       log_num_zeros_in_grad=True,
                                       use_distributed_optimizer=distributed_optimizer)
    return model, config, get_megatron_optimizer(optimizer_config, [model])


def _run(rank, world, precision, distributed_optimizer):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    model, config, megatron_optimizer = _build(precision, distributed_optimizer)
    # The NaN gradient is made in the last rank's backward (a hook on the parameter, before
    # Megatron's DDP reduces it), where a fault of the backward itself would appear.
    target = dict(model.module.named_parameters())[TARGET]
    poison = [False]
    target.register_hook(lambda grad: grad * float("nan") if poison[0] else grad)
    optimizer = GuardedMegatronOptimizer(megatron_optimizer, model, policy=POLICY,
                                         collective_timeout=60)
    config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's training.py does
    inner = optimizer._inner
    main_params = [p for g in inner.optimizer.param_groups for p in g["params"]]
    steps, after, mains = [], {}, {}
    positions = DataPositions()  # the loop's data iterator, one item per micro-batch
    for _ in range(STEPS):
        step = optimizer.guard.stats().step_count + 1
        dropped = optimizer.drop_batches(positions, MICRO)  # the last rollback's batches
        batches = _batches(positions.position, rank)
        for _ in batches:
            next(positions)
        factor = 1.0
        if step == NAN_LOSS and rank == world - 1:
            factor = float("nan")
        if step == SPIKE:
            factor = 300.0
        forward_step = _forward_step(factor)

        poison[0] = step == NAN_GRAD and rank == world - 1
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(forward_step_func=forward_step,
                                             data_iterator=iter(batches),
                                             model=[model], num_microbatches=MICRO,
                                             seq_length=8, micro_batch_size=2,
                                             forward_only=False)
        poison[0] = False
        success, grad_norm, zeros = optimizer.step()
        report = optimizer.last_report
        flat = torch.cat([p.detach().float().reshape(-1) for p in model.module.parameters()])
        main = torch.cat([p.detach().reshape(-1) for p in main_params])
        after[report.step], mains[report.step] = flat, main
        # A step the guard skipped changed nothing (Megatron did not apply it either).
        unchanged = (torch.equal(flat, after[report.step - 1])
                     and torch.equal(main, mains[report.step - 1])
                     if report.skipped and report.step - 1 in after else None)
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        steps.append({
            "step": report.step, "outcome": report.outcome, "returned": [success, grad_norm,
                                                                         zeros],
            "grad_norm": report.grad_norm, "incident": report.incident,
            "loss": report.loss, "micro_loss_mean": float(torch.stack(
                [d["loss"] for d in losses]).mean()),
            "equal_across_ranks": all(torch.equal(flat, t) for t in gathered),
            "finite": bool(torch.isfinite(flat).all()), "unchanged": unchanged,
            "batches_to_skip": report.batches_to_skip, "dropped": dropped,
            "restored_snapshot": ((torch.equal(flat, after[report.rolled_back_to])
                                   and torch.equal(main, mains[report.rolled_back_to]))
                                  if report.rolled_back else None),
        })
    return {"steps": steps, "optimizer": type(inner).__name__}


def _mtp_is_refused():
    """A model with multi-token prediction is refused at construction (not run with the guard;
    MoE models are guarded: test_megatron_moe.py)."""
    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    model, config, megatron_optimizer = _build("fp32", False)
    config.mtp_num_layers = 1
    try:
        GuardedMegatronOptimizer(megatron_optimizer, model, policy=POLICY)
    except ValueError as e:
        return "multi-token-prediction" in str(e)
    return False


def train_steps(model, config, optimizer, steps, rank=0):
    """`steps` steps of MICRO micro-batches (seeded by step and rank) through Megatron's
    forward-backward schedule and `optimizer.step()`; the model's parameters after them."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config.grad_scale_func = optimizer.scale_loss
    for step in range(steps):
        batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(
            10 * step + micro + 100 * rank)) for micro in range(MICRO)]

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            positions = torch.arange(batch.shape[1]).unsqueeze(0).expand_as(batch)
            output = model(batch, positions, None, labels=batch)
            return output, lambda out: (out.float().mean(), {})

        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches),
                                    model=[model], num_microbatches=MICRO, seq_length=8,
                                    micro_batch_size=2, forward_only=False)
        optimizer.step()
    return torch.cat([p.detach().float().reshape(-1) for p in model.module.parameters()])


def _with_the_megatron_preset(rank, guarded, steps=3):
    """bf16 steps with the ``megatron`` preset (its loss_scale section: DynamicGradScaler's
    numbers, 2^32 initial) or unguarded: inside Megatron the section is Megatron's scaler's, so
    the guard scales nothing and the steps are Megatron's (before, the guard unscaled bf16
    gradients by 2^-32). Returns the model parameters and the guard's loss scale."""
    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    model, config, optimizer = _build("bf16", False)
    if guarded:
        optimizer = GuardedMegatronOptimizer(optimizer, model, policy="megatron")
    before = torch.cat([p.detach().float().reshape(-1) for p in model.module.parameters()])
    flat = train_steps(model, config, optimizer, steps, rank)
    return flat, before, optimizer.guard.stats().loss_scale if guarded else None


def _megatron_preset_steps_as_megatron(rank):
    guarded, before, scale = _with_the_megatron_preset(rank, True)
    plain, _, _ = _with_the_megatron_preset(rank, False)
    return {"scale": scale, "close": bool(torch.allclose(guarded, plain, rtol=0, atol=1e-6)),
            "moved": not torch.equal(plain, before)}


def _rank_main(rank, world, port, out_dir, configs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron_cpu
    megatron_cpu.install()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for precision, distributed_optimizer in configs:
        key = "%s-%s" % (precision, "distopt" if distributed_optimizer else "ddp")
        results[key] = _run(rank, world, precision, distributed_optimizer)
    results["mtp_refused"] = _mtp_is_refused()
    results["megatron_preset"] = _megatron_preset_steps_as_megatron(rank)
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f, default=str)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _launch(world, configs):
    return spawn_ranks(_rank_main, world, configs)


def _check(ranks, key, world):
    precision, kind = key.split("-")
    expected = {"ddp": {"fp32": "FP32Optimizer", "bf16": "Float16OptimizerWithFloat16Params"},
                "distopt": {"fp32": "DistributedOptimizer", "bf16": "DistributedOptimizer"}}
    for rank, result in enumerate(ranks):
        run = result[key]
        assert run["optimizer"] == expected[kind][precision], (key, run["optimizer"])
        steps = {s["step"]: s for s in run["steps"]}
        for s in run["steps"]:
            assert s["equal_across_ranks"] and s["finite"], (key, rank, s)
            success, grad_norm, zeros = s["returned"]
            if s["outcome"] == "applied":
                # Megatron's own values, and the guard's norm is Megatron's.
                assert success is True and zeros is not None, (key, rank, s)
                assert grad_norm == pytest.approx(s["grad_norm"], rel=1e-6), (key, rank, s)
            else:
                assert s["returned"] == [False, None, None], (key, rank, s)
        assert steps[NAN_GRAD]["outcome"] == "skipped", (key, rank, run["steps"])
        assert steps[NAN_LOSS]["outcome"] == "skipped", (key, rank, run["steps"])
        assert steps[NAN_GRAD]["unchanged"] and steps[NAN_LOSS]["unchanged"], (key, rank)
        assert steps[NAN_LOSS]["incident"]["ranks"] == [world - 1], (key, steps[NAN_LOSS])
        # The NaN gradient made on the last rank is traced to it, not to every rank the
        # all-reduce reached (DDP) or to the rank whose shard holds it (distributed optimizer).
        assert steps[NAN_GRAD]["incident"]["ranks"] == [world - 1], (key, steps[NAN_GRAD])
        assert steps[SPIKE]["outcome"] == "rolled_back", (key, rank, run["steps"])
        # Main (fp32) and model parameters are both the snapshot's again.
        assert steps[SPIKE]["restored_snapshot"], (key, rank, steps[SPIKE])
        # The rollback's batches drawn by drop_batches before the next step, none elsewhere.
        assert steps[SPIKE]["batches_to_skip"] > 0, steps[SPIKE]
        assert [s["dropped"] for s in run["steps"]] == [
            steps[SPIKE]["batches_to_skip"] if s["step"] == SPIKE + 1 else 0
            for s in run["steps"]], (key, rank)
        assert len(run["steps"]) == STEPS and run["steps"][-1]["outcome"] == "applied"
    # The guard's loss is the step's: the mean of the micro-batch losses Megatron reports, over
    # the ranks (Megatron hands grad_scale_func each loss divided by the micro-batch count).
    for i, s in enumerate(ranks[0][key]["steps"]):
        if s["outcome"] == "applied":
            mean = sum(r[key]["steps"][i]["micro_loss_mean"] for r in ranks) / len(ranks)
            assert s["loss"] == pytest.approx(mean, rel=1e-6), (key, s, mean)
    blamed = [r[key]["steps"][NAN_GRAD - 1]["incident"]["tensors"] for r in ranks]
    assert any(TARGET in t for t in blamed), (key, blamed)
    if kind == "ddp":
        assert all(TARGET in t for t in blamed), (key, blamed)


def test_fp32_bf16_and_the_distributed_optimizer_on_two_ranks():
    ranks = _launch(2, CONFIGS)
    for precision, distributed_optimizer in CONFIGS:
        _check(ranks, "%s-%s" % (precision, "distopt" if distributed_optimizer else "ddp"), 2)
    for r in ranks:  # the megatron preset inside Megatron bf16: Megatron's own steps
        preset = r["megatron_preset"]
        assert preset["scale"] == 1.0 and preset["close"] and preset["moved"], preset


def test_bf16_distributed_optimizer_on_one_rank():
    ranks = _launch(1, [("bf16", True)])
    _check(ranks, "bf16-distopt", 1)
    assert ranks[0]["mtp_refused"] is True


def test_the_megatron_version_is_checked_against_the_tested_range():
    """The installed megatron-core is one of the tested releases; an older one is refused with the
    range named, a newer one warned about (its public stages are likely still there)."""
    import megatron.core
    from stepguard.integrations import megatron as integration

    oldest, newest = integration.TESTED_VERSIONS
    assert getattr(megatron.core, "__shortversion__", megatron.core.__version__) in (oldest, newest)
    integration.check_megatron_version()  # the installed one: no error
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.15\.3 is older than the releases "
                                           r"tested \(0\.16\.1 to 0\.19\.2\)"):
        integration.check_megatron_version("0.15.3")
    with pytest.raises(RuntimeError, match="cannot read the megatron-core version 'garbage'"):
        integration.check_megatron_version("garbage")
    with pytest.warns(RuntimeWarning, match=r"megatron-core 0\.20\.0rc1 is newer"):
        integration.check_megatron_version("0.20.0rc1")
    for tested in ("0.16.1", "0.17.0", "0.19.2", "0.19.2+78b9952", "0.19.2rc1"):
        integration.check_megatron_version(tested)

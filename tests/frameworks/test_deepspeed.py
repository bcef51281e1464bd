"""stepguard inside the real DeepSpeed engine on CPU (DS_ACCELERATOR=cpu) with Gloo: ZeRO stages
0, 1 and 2, fp32 and bf16, the config's fused AdamW and BF16_Optimizer, ZeRO 3 fp32 and bf16 (its
parameters kept whole beside their partitions, DeepSpeed's default for small ones, and not), on
2 ranks (and one configuration on 1 rank); and ZeRO 2 and 3 fp16 with DeepSpeed's loss scaler
beside an unguarded twin. Each configuration trains a small model for 12 steps of 2 accumulated
micro-batches with three faults: a NaN gradient of one parameter on the last rank (step 3), a NaN
in its batch (step 5) and a loss spike on every rank (step 8); DeepSpeed's Muon in the same
layouts; ZeRO 1 fp32, ZeRO 2 bf16 and ZeRO 3 bf16 with the optimizer offloaded to the CPU
(ZeRO-Offload). fp16: test_deepspeed_fp16.py; MoE: test_deepspeed_refusals.py; seams:
test_deepspeed_seams.py; the optimizer state checked and reset under ZeRO 2:
test_deepspeed_state.py."""

import json
import os

import pytest
import torch
import torch.nn as nn

os.environ["DS_ACCELERATOR"] = "cpu"
import deepspeed  # noqa: E402  (a missing DeepSpeed fails the test)

import stepguard.integrations.deepspeed as sg_deepspeed  # noqa: E402
from conftest import (POLICY, DataPositions, counted_calls, deepspeed_step_counters,  # noqa
                      spawn_ranks)

CONFIGS = [(0, "fp32"), (0, "bf16"), (1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"),
           (0, "bf16-fused"),  # the config's AdamW as DeepSpeed builds it: FusedAdam, FP16_Optimizer
           (1, "bf16-fused"),  # ZeRO 1 over the config's AdamW (DeepSpeed's FusedAdam)
           (1, "bf16-fp32accum"),  # fp32 gradient accumulation: BF16_Optimizer
           # DeepSpeed's Muon (MuonWithAuxAdam): itself, under ZeRO 1 and 2, BF16_Optimizer
           (0, "fp32-muon"), (1, "bf16-muon"), (2, "fp32-muon"), (1, "bf16-fp32accum-muon"),
           # ZeRO-Offload: the optimizer steps the fp32 partitions on the host
           (1, "fp32-offload"), (2, "bf16-offload")]
# DeepSpeed's own step with its own norm: bf16 without ZeRO (FP16_UnfusedOptimizer,
# FP16_Optimizer) and BF16_Optimizer.
OWN_NORM = ("0-bf16", "0-bf16-fused", "1-bf16-fp32accum", "1-bf16-fp32accum-muon",
            "3-fp32-muon")
STEPS, NAN_GRAD, NAN_BATCH, SPIKE = 12, 3, 5, 8
MICRO = 2  # gradient accumulation: micro-batches per optimizer step


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _batch(step, rank, dtype):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    return x.to(dtype), y.to(dtype)


def _flat_params(model):
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO 3: each rank holds a partition
        with deepspeed.zero.GatheredParameters(params):  # every rank together
            return torch.cat([p.detach().float().reshape(-1).clone() for p in params])
    return torch.cat([p.detach().float().reshape(-1) for p in params])


def _run(rank, world, stage, precision, checkpoint_dir):
    """One engine, 12 steps; returns what every rank saw, step by step. A precision ending in
    "-fused" leaves out ``torch_adam``: the config's AdamW is then DeepSpeed's FusedAdam."""
    flags = set(precision.split("-")[1:])
    fused, fp32_accum, muon = "fused" in flags, "fp32accum" in flags, "muon" in flags
    partitioned = "partitioned" in flags  # ZeRO 3: no parameter kept whole
    precision = precision.split("-")[0]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = _model()
    for p in model.parameters():
        p.use_muon = muon and p.ndim >= 2  # Muon on the matrices, its Adam on the biases
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")],
               "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
               "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": MICRO,
              "optimizer": {"type": "AdamW",
                            "params": {"lr": 1e-2} if fused else {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
              "bf16": {"enabled": precision == "bf16"}}
    if fp32_accum:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if muon:
        config["optimizer"] = {"type": "Muon", "params": {"lr": 1e-2}}
        config["zero_optimization"]["reduce_scatter"] = False  # ZeRO 3 requires it
    if partitioned:
        config["zero_optimization"]["param_persistence_threshold"] = 0
    if "offload" in flags:  # torch's AdamW on the host copies (DeepSpeedCPUAdam is a C++ build)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=groups, config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s))
    # The NaN gradient of step 3 arrives from backward (a hook registered before the guard's,
    # so the gradient the guard's watch sees is already NaN, as a fault of the backward's own).
    poison = [False]
    target = dict(engine.module.named_parameters())["2.weight"]
    target.register_hook(lambda g: g * float("nan") if poison[0] else g)
    guarded = sg_deepspeed.guard_engine(engine, policy=POLICY, collective_timeout=60)
    steps, after, counts = [], {}, None
    positions = DataPositions()  # the loop's data iterator
    for _ in range(STEPS):
        step = guarded.guard.stats().step_count + 1
        # The batches the last rollback drops: MICRO micro-batches each, drawn by the guard.
        before = positions.position
        dropped = guarded.drop_batches(positions)
        drawn = positions.position - before
        poison[0] = step == NAN_GRAD and rank == world - 1
        reference = None
        for micro in range(MICRO):  # engine.step() after every micro-batch, as DeepSpeed's loop
            x, y = _batch(next(positions), rank, dtype)
            if step == NAN_BATCH and rank == world - 1 and micro == 0:
                x[0, 0] = float("nan")
            if step == SPIKE:
                y = y * 300
            engine.backward(nn.functional.mse_loss(engine(x).float(), y.float()))
            if micro == MICRO - 1 and stage == 0:
                # The accumulated, averaged gradients' norm, computed here (DeepSpeed's is the
                # guard's since the integration hands it the agreed norm).
                reference = float(torch.nn.utils.get_total_norm(
                    [p.grad.float() for p in engine.module.parameters()]))
            if micro == MICRO - 1 and step == STEPS:
                counts = _count_in_step(engine, guarded.guard)
            else:
                engine.step()
        poison[0] = False
        report = guarded.last_report
        assert report.step == step  # one guarded step per gradient-accumulation boundary
        ds_norm = engine.get_global_grad_norm()
        flat = _flat_params(engine.module)
        after[report.step] = flat
        # A step the guard skipped changed no parameter (DeepSpeed did not apply it either).
        unchanged = (torch.equal(flat, after[report.step - 1])
                     if report.skipped and report.step - 1 in after else None)
        gathered = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(gathered, flat)
        steps.append({
            "step": report.step, "outcome": report.outcome, "grad_norm": report.grad_norm,
            "ds_norm": None if ds_norm is None else float(ds_norm), "reference": reference,
            "skipped_steps": engine.skipped_steps, "scheduler_epoch": scheduler.last_epoch,
            "lr": engine.get_lr()[0], "equal_across_ranks": all(torch.equal(flat, t)
                                                               for t in gathered),
            "incident": report.incident, "rolled_back_to": report.rolled_back_to,
            "restored_snapshot": (torch.equal(flat, after[report.rolled_back_to])
                                  if report.rolled_back else None),
            "finite": bool(torch.isfinite(flat).all()), "unchanged": unchanged,
            "batches_to_skip": report.batches_to_skip, "dropped": [dropped, drawn],
        })
    # DeepSpeed's own checkpoint carries the guard's decision state as client state.
    engine.save_checkpoint(checkpoint_dir, client_state=guarded.state_dict())
    before = guarded.guard.guard_state_dict()
    _, client_state = engine.load_checkpoint(checkpoint_dir)
    guarded.load_state_dict(client_state)
    resumed = {"same_state": guarded.guard.guard_state_dict() == before,
               "equal": torch.equal(_flat_params(engine.module), after[STEPS])}
    for _ in range(MICRO):
        x, y = _batch(next(positions), rank, dtype)
        engine.backward(nn.functional.mse_loss(engine(x).float(), y.float()))
        engine.step()
    resumed["next"] = [guarded.last_report.step, guarded.last_report.outcome]
    return {"steps": steps, "optimizer": type(engine.optimizer).__name__, "resumed": resumed,
            "offload": bool(getattr(engine.optimizer, "cpu_offload", False) or
                            getattr(engine.optimizer, "offload_optimizer", False)),
            "counts": counts, "basic": type(engine.basic_optimizer).__name__}


def _count_in_step(engine, guard):
    """engine.step() of a clean step, counting what runs inside the engine's optimizer step (the
    guarded one): all-reduces through torch.distributed (DeepSpeed's norm and overflow check
    make them), DeepSpeed's and torch's norm functions, and the guard's collectives."""
    inside = [False]
    step = engine.optimizer.step

    def guarded_step(*args, **kwargs):
        inside[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            inside[0] = False
    engine.optimizer.step = guarded_step
    before = guard.stats().collective_calls
    try:
        with counted_calls(deepspeed_step_counters(), when=lambda: inside[0]) as counts:
            engine.step()
    finally:
        engine.optimizer.step = step
    counts = dict(counts, guard=guard.stats().collective_calls - before)
    return counts


def _refusals():
    """What the integration does not guard is refused with a message naming it."""
    out = {}
    base = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6}
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=base)  # no optimizer
    stage3 = dict(base, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                  zero_optimization={"stage": 3})
    model = _model()
    engine3, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                            config=stage3)
    for name, e in (("no_optimizer", engine), ("zero3", engine3)):
        try:
            sg_deepspeed.guard_engine(e, policy=POLICY)
            out[name] = "accepted"
        except ValueError as error:
            out[name] = str(error)
    out["applied_anyway"] = _applied_anyway(base)
    real = deepspeed.__version__
    deepspeed.__version__ = "0.18.0"
    try:
        sg_deepspeed.guard_engine(engine3, policy=POLICY)
        out["old_release"] = "accepted"
    except RuntimeError as error:
        out["old_release"] = str(error)
    finally:
        deepspeed.__version__ = real
    out["manual_scale"] = _manual_scale(base)
    return out


def _manual_scale(base):
    """DeepSpeed's manual path, engine.scale(loss).backward(): the guard gets the loss (a NaN
    loss at step 2 is skipped). DeepSpeed allows it from ZeRO stage 1."""
    config = dict(base, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                  zero_optimization={"stage": 1})
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    guarded = sg_deepspeed.guard_engine(engine, policy=POLICY)
    outcomes = []
    for step in range(3):
        x, y = _batch(step, 0, torch.float32)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.scale(loss * float("nan") if step == 1 else loss).backward()
        engine.step()
        outcomes.append(guarded.last_report.outcome)
    out = [guarded.last_report.loss, guarded.last_report.loss_given, outcomes]
    # A client state saved without the guard's entry: said, and the guard keeps its state.
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded.load_state_dict({})
    return out + [[str(w.message) for w in caught], guarded.guard.stats().step_count]


def _applied_anyway(base):
    """A DeepSpeed that applies a step the guard skipped (as a release that inlined its overflow
    check would): the integration notices at the next step and stops, naming the step."""
    config = dict(base, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}})
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    guarded = sg_deepspeed.guard_engine(engine, policy=POLICY)
    guarded._layout.skip = lambda ds_step: ds_step()  # DeepSpeed steps, overflow stays False
    for step in range(3):
        x, y = _batch(step, 0, torch.float32)
        if step == 1:
            x[0, 0] = float("nan")
        try:
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        except RuntimeError as error:
            return [step, str(error)]
    return "not noticed"


def _rank_main(rank, world, port, out_dir, configs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for stage, precision in configs:
        key = "%d-%s" % (stage, precision)
        results[key] = _run(rank, world, stage, precision, os.path.join(out_dir, key))
    if world == 1:
        results["refusals"] = _refusals()
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f, default=str)
    torch.distributed.destroy_process_group()


def _launch(world, configs):
    return spawn_ranks(_rank_main, world, configs)


def _check(ranks, key, world):
    expected_types = {0: ("AdamW", "FP16_UnfusedOptimizer")}
    for rank, result in enumerate(ranks):
        run = result[key]
        stage, precision = key.split("-")[:2]
        if key.endswith("-muon"):
            assert run["basic"] == "MuonWithAuxAdam", run["basic"]
        if key.endswith("-fused"):
            assert run["basic"] == "FusedAdam", run["basic"]
        if key == "0-bf16-fused":
            assert run["optimizer"] == "FP16_Optimizer", run["optimizer"]
        elif "-fp32accum" in key:
            assert run["optimizer"] == "BF16_Optimizer", run["optimizer"]
        elif key == "0-fp32-muon":
            assert run["optimizer"] == "MuonWithAuxAdam", run["optimizer"]
        elif stage == "0":
            assert run["optimizer"] == expected_types[0][precision == "bf16"], run["optimizer"]
        elif stage == "3":
            assert run["optimizer"] == "DeepSpeedZeroOptimizer_Stage3", run["optimizer"]
        else:
            assert run["optimizer"] == "DeepSpeedZeroOptimizer", run["optimizer"]
        assert run["offload"] == key.endswith("-offload"), (key, run["offload"])
        steps = {s["step"]: s for s in run["steps"]}
        outcomes = [s["outcome"] for s in run["steps"]]
        applied = 0
        for s in run["steps"]:
            assert s["equal_across_ranks"], (key, rank, s)  # replicas equal after every step
            assert s["finite"], (key, rank, s)
            if s["outcome"] == "applied":
                applied += 1
                norm = s["reference"] if s["reference"] is not None else s["ds_norm"]
                if key == "3-fp32-muon":  # DeepSpeed's norm is the orthogonalised update's
                    assert 0.0 < s["ds_norm"] < float("inf"), (key, rank, s)
                else:
                    assert norm == pytest.approx(s["grad_norm"], rel=1e-6), (key, rank, s)
            # DeepSpeed's own counters follow the guard: a step not applied is a skipped step
            # and the LR scheduler steps only on applied steps.
            assert s["skipped_steps"] == s["step"] - applied, (key, rank, s)
            assert s["scheduler_epoch"] == applied, (key, rank, s)
        assert steps[NAN_GRAD]["outcome"] == "skipped", (key, rank, outcomes)
        assert steps[NAN_BATCH]["outcome"] == "skipped", (key, rank, outcomes)
        assert steps[NAN_GRAD]["unchanged"] and steps[NAN_BATCH]["unchanged"], (key, rank)
        assert steps[NAN_BATCH]["incident"]["ranks"] == [world - 1], (key, steps[NAN_BATCH])
        # The NaN gradient made on the last rank is traced to it at every stage, not to the
        # rank whose partition holds the reduced gradient (ZeRO 1/2/3: rank 0 for '2.weight').
        assert steps[NAN_GRAD]["incident"]["ranks"] == [world - 1], (key, steps[NAN_GRAD])
        if world > 1 and rank == world - 1:
            assert any(line.startswith("this rank's own gradients held NaN/Inf before the "
                                       "framework reduced them")
                       for line in steps[NAN_GRAD]["incident"]["evidence"]), (key, steps[NAN_GRAD])
        spike = steps[SPIKE]
        assert spike["outcome"] == "rolled_back", (key, rank, outcomes)
        # The batches the rollback drops, drawn by drop_batches before the next step (each
        # MICRO micro-batches), and none at any other step.
        skip = spike["batches_to_skip"]
        assert skip > 0 and steps[SPIKE + 1]["dropped"] == [skip, skip * MICRO], (key, steps)
        assert all(s["dropped"] == [0, 0] for s in run["steps"] if s["step"] != SPIKE + 1)
        assert spike["restored_snapshot"], (key, rank, spike)
        assert len(run["steps"]) == STEPS and run["steps"][-1]["outcome"] == "applied"
        assert run["resumed"] == {"same_state": True, "equal": True,
                                  "next": [STEPS + 1, "applied"]}, (key, rank, run["resumed"])
        # A clean step: the guard's one collective; DeepSpeed neither computes a norm nor
        # all-reduces in its step (it takes the agreed norm), except where its own step runs
        # with its own norm (bf16 without ZeRO, BF16_Optimizer: no copy of their step).
        if key in OWN_NORM:  # a norm per parameter group (FP16_UnfusedOptimizer) or one
            # (ZeRO 3's own norm function is not counted: its all-reduce is)
            counts = run["counts"]
            assert counts["norms"] + counts["all_reduce"] >= 1 and counts["guard"] == 1, counts
        else:
            assert run["counts"] == {"all_reduce": 0, "norms": 0, "guard": 1}, (key, run["counts"])
    # The NaN gradient of '2.weight' is named by the rank(s) holding that parameter's gradient.
    blamed = [r[key]["steps"][NAN_GRAD - 1]["incident"]["tensors"] for r in ranks]
    assert any("2.weight" in t for t in blamed), (key, blamed)
    if world == 1 or key.startswith("0-"):
        assert all("2.weight" in t for t in blamed), (key, blamed)


def test_every_zero_stage_and_precision_on_two_ranks(capfd):
    ranks = _launch(2, CONFIGS)
    for stage, precision in CONFIGS:
        _check(ranks, "%d-%s" % (stage, precision), 2)
    # The guard reads no .grad of ZeRO's partition views (autograd warned once per parameter per
    # step per rank: 174 lines in 3 steps).
    err = capfd.readouterr().err
    assert "is not a leaf Tensor is being accessed" not in err, err[-3000:]


def test_zero_two_bf16_on_one_rank_and_what_is_refused():
    ranks = _launch(1, [(2, "bf16")])
    _check(ranks, "2-bf16", 1)
    refusals = ranks[0]["refusals"]
    assert "without an optimizer" in refusals["no_optimizer"], refusals
    assert refusals["zero3"] == "accepted", refusals  # ZeRO 3 is guarded (its own test)
    step, error = refusals["applied_anyway"]
    assert step == 1 and "DeepSpeed applied step 2, which the guard did not apply" in error, error
    assert "deepspeed 0.18.0 is older than the releases tested (0.19.8)" in \
        refusals["old_release"], refusals["old_release"]
    loss, given, outcomes, fresh, step_count = refusals["manual_scale"]
    assert given and outcomes == ["applied", "skipped", "applied"], refusals["manual_scale"]
    assert len(fresh) == 1 and "holds no guard state" in fresh[0] and step_count == 3, fresh
    assert "keeps the state it has (after its step 3)" in fresh[0], fresh


# ZeRO 3 with DeepSpeed's default persistence threshold (this model's parameters are all small
# enough to be kept whole besides their partitions) and with none kept whole; with the optimizer
# offloaded to the CPU (fp32 masters and their gradients on the host).
ZERO3 = [(3, "fp32"), (3, "bf16"), (3, "bf16-partitioned"),
         (3, "fp32-muon"),  # Muon: DeepSpeed's own norm (it orthogonalises inside its step)
         (3, "bf16-offload")]


def test_zero_three_on_two_ranks():
    ranks = _launch(2, ZERO3)
    for stage, precision in ZERO3:
        _check(ranks, "%d-%s" % (stage, precision), 2)

"""stepguard inside DeepSpeed fp16 with DeepSpeed's own loss scaler (ZeRO 2 and 3, CPU, Gloo, 2
ranks), beside an unguarded twin: the startup overflow streak, a NaN gradient later, and a scale
held at DeepSpeed's min_loss_scale where the policy decides instead of DeepSpeed's exit."""

import json
import os

import pytest
import torch
import torch.nn as nn

os.environ["DS_ACCELERATOR"] = "cpu"
import deepspeed  # noqa: E402  (a missing DeepSpeed fails the test)

import stepguard.integrations.deepspeed as sg_deepspeed  # noqa: E402
from conftest import fp16_on_any_cpu, spawn_ranks  # noqa: E402
from test_deepspeed import _batch, _flat_params, _model  # noqa: E402


FP16_STEPS, FP16_NAN = 24, 18


def _fp16_run(rank, world, guarded, stage=2):
    """ZeRO 2 fp16 with DeepSpeed's DynamicLossScaler (initial scale 2^24: far too high, the first
    steps overflow), 24 steps, a NaN gradient on the last rank at step 18; guarded or not. No
    clipping, so that the update does not depend on the norm and the twins compare bit for bit
    (with clipping DeepSpeed takes the guard's norm, its own within 1e-6: the other tests)."""
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
              "fp16": {"enabled": True, "initial_scale_power": 24, "hysteresis": 2,
                       "loss_scale_window": 4, "min_loss_scale": 1}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    sg = sg_deepspeed.guard_engine(engine, policy="default", collective_timeout=60) \
        if guarded else None
    target = dict(engine.module.named_parameters())["2.weight"]
    rows = []
    for step in range(1, FP16_STEPS + 1):
        hook = None
        if step == FP16_NAN and rank == world - 1:
            hook = target.register_hook(lambda g: g * float("nan"))
        scale_before = float(engine.optimizer.loss_scale)
        x, y = _batch(step, rank, torch.float16)
        engine.backward(nn.functional.mse_loss(engine(x).float(), y.float()))
        engine.step()
        if hook is not None:
            hook.remove()
        row = {"scale_before": scale_before, "scale": float(engine.optimizer.loss_scale),
               "skipped_steps": engine.skipped_steps, "params": _flat_params(engine.module)}
        if sg is not None:
            r = sg.last_report
            row.update(outcome=r.outcome, loss_scale=r.loss_scale, grad_norm=r.grad_norm,
                       ds_norm=float(engine.get_global_grad_norm()),
                       signal=r.incident["signal"] if r.incident else None,
                       cause=r.incident["cause"] if r.incident else None)
        rows.append(row)
    return rows


FLOOR_STEPS = 12


def _fp16_floor_run(rank, world, guarded):
    """ZeRO 2 fp16 whose scale starts at DeepSpeed's min_loss_scale (2^24, far too high): every
    step overflows. Unguarded, DeepSpeed exits ("Current loss scale already at minimum") once its
    hysteresis is spent; guarded with the deepspeed-fp16 preset (its loss_scale section taken as
    DeepSpeed's scaler's), each step is skipped through DeepSpeed's overflow path and after 10 in
    a row the preset lowers the LR. Returns each step's outcome, signal and LR factor, or the
    error that ended the run."""
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
              "fp16": {"enabled": True, "initial_scale_power": 24, "hysteresis": 2,
                       "loss_scale_window": 4, "min_loss_scale": 2 ** 24}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    sg = sg_deepspeed.guard_engine(engine, policy="deepspeed-fp16", collective_timeout=60) \
        if guarded else None
    rows = []
    for step in range(1, FLOOR_STEPS + 1):
        x, y = _batch(step, rank, torch.float16)
        engine.backward(nn.functional.mse_loss(engine(x).float(), y.float()))
        try:
            engine.step()
        except Exception as error:  # DeepSpeed's exit at its floor
            return {"rows": rows, "error": str(error), "at": step}
        row = {"scale": float(engine.optimizer.loss_scale), "skipped_steps": engine.skipped_steps}
        if sg is not None:
            r = sg.last_report
            row.update(outcome=r.outcome, lr_factor=r.lr_factor, loss_scale=r.loss_scale,
                       signal=r.incident["signal"] if r.incident else None,
                       guard_scale=sg.guard.stats().loss_scale)
        rows.append(row)
    return {"rows": rows, "error": None}


def _fp16_main(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    fp16_on_any_cpu()
    plain, guarded = _fp16_run(rank, world, False), _fp16_run(rank, world, True)
    same = [torch.equal(a.pop("params"), b.pop("params")) for a, b in zip(plain, guarded)]
    plain3, guarded3 = _fp16_run(rank, world, False, 3), _fp16_run(rank, world, True, 3)
    same3 = [torch.equal(a.pop("params"), b.pop("params")) for a, b in zip(plain3, guarded3)]
    floor = {"plain": _fp16_floor_run(rank, world, False),
             "guarded": _fp16_floor_run(rank, world, True)}
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump({"plain": plain, "guarded": guarded, "same_params": same, "floor": floor,
                   "zero3": {"plain": plain3, "guarded": guarded3, "same_params": same3}},
                  f, default=str)
    torch.distributed.destroy_process_group()


def _check_fp16_twin(rank, got, stage=2):
    """One rank's fp16 run beside its unguarded twin (ZeRO 2 or 3): see the test."""
    plain, guarded = got["plain"], got["guarded"]
    assert [r["scale"] for r in guarded] == [r["scale"] for r in plain], (rank, guarded)
    assert [r["skipped_steps"] for r in guarded] == [r["skipped_steps"] for r in plain]
    assert all(got["same_params"]), (rank, got["same_params"])
    # The startup streak: the first steps, skipped until the scale fits. Every step of it,
    # those whose averaged gradients hold only NaN (Inf met -Inf) included, is an overflow;
    # so is every later skip (the scale grown too far again, the NaN gradient at step 18).
    streak = next(i for i, r in enumerate(guarded) if r["outcome"] == "applied")
    assert streak >= 3, guarded[:4]
    for r in guarded:
        if r["outcome"] == "skipped":
            assert r["signal"] == "overflow" and r["cause"] == "precision_overflow", r
    assert plain[-1]["scale"] < 2 ** 24  # the scale came down
    for r in guarded:
        assert r["loss_scale"] == r["scale_before"], r  # DeepSpeed's, at this step
        if r["outcome"] == "applied":
            # ZeRO 3 divides the norm it reports by the scale after its update (the grown one
            # on a growth step); the guard's is the norm of the step's gradients.
            ds_norm = float(r["ds_norm"]) * (r["scale"] / r["scale_before"] if stage == 3 else 1)
            assert r["grad_norm"] == pytest.approx(ds_norm, rel=1e-5), r
    # A NaN gradient while the scale can back off is skipped as DeepSpeed skips it (its scaler
    # backs off): the overflow path.
    assert guarded[FP16_NAN - 1]["outcome"] == "skipped", guarded[FP16_NAN - 1]
    assert guarded[-1]["outcome"] == "applied"


def test_fp16_zero_two_and_three_follow_deepspeeds_scaler_as_an_unguarded_twin():
    """The guard inside DeepSpeed fp16 (ZeRO 2 and 3, 2 ranks): DeepSpeed's scaler owns the
    scale. The startup overflow streak is `overflow` / `precision_overflow` on every step, skipped by
    DeepSpeed's own overflow path, and the scale backs off as without the guard (hysteresis 2):
    the same scale, skipped count and parameters, step for step, as an unguarded twin; the
    reports carry DeepSpeed's scale; a NaN gradient later is skipped as DeepSpeed would."""
    ranks = spawn_ranks(_fp16_main, 2)
    for rank, got in enumerate(ranks):
        _check_fp16_twin(rank, got)
        _check_fp16_twin(rank, got["zero3"], 3)  # the same under ZeRO 3
        # At DeepSpeed's floor: unguarded, DeepSpeed exits at the second overflow (hysteresis 2);
        # guarded, every step is skipped through its overflow path, the scale stays at the floor,
        # and the deepspeed-fp16 preset lowers the LR after 10 bad steps in a row.
        floor = got["floor"]
        assert floor["plain"]["at"] == 2 and "already at minimum" in floor["plain"]["error"]
        rows = floor["guarded"]["rows"]
        assert floor["guarded"]["error"] is None and len(rows) == FLOOR_STEPS, floor["guarded"]
        assert all(r["outcome"] == "skipped" and r["signal"] == "nonfinite_grad" for r in rows)
        assert [r["skipped_steps"] for r in rows] == list(range(1, FLOOR_STEPS + 1))
        assert {r["scale"] for r in rows} == {2.0 ** 24} and {r["loss_scale"] for r in rows} == {
            2.0 ** 24}
        assert {r["guard_scale"] for r in rows} == {1.0}  # the preset turned no guard scaler on
        assert [r["lr_factor"] for r in rows[8:11]] == [1.0, 0.5, 0.5], rows

"""The DeepSpeed integration's declared seams with the real DeepSpeed (CPU, Gloo): with
``framework_norm=True`` and a binding clip a clean guarded run is bitwise its unguarded twin's
(ZeRO 0 fp32, bf16 without ZeRO, ZeRO 2 bf16, BF16_Optimizer, ZeRO 3, 2 ranks), and so is a
run with the guard off (``enabled=False``: no collective); what
``guard_engine`` writes on DeepSpeed's objects is what the seams table declares and
``detach()`` puts it all back; a DeepSpeed function the integration relies on that changed is
refused at ``guard_engine``, naming it, unless the user opts in."""

import json
import os
import warnings

import torch
import torch.nn as nn

os.environ["DS_ACCELERATOR"] = "cpu"
import deepspeed  # noqa: E402  (a missing DeepSpeed fails the test)

import stepguard.integrations.deepspeed as sg_deepspeed  # noqa: E402
from stepguard.integrations import _seams  # noqa: E402
from conftest import spawn_ranks  # noqa: E402
from test_deepspeed import _batch, _flat_params, _model  # noqa: E402

STEPS = 6
CLIP = 0.05  # binds on every step of this model (its norms are 0.3 to 1)
# (ZeRO stage, precision, fp32 gradient accumulation): the layouts of the DeepSpeed test.
TWINS = [(0, "fp32", False), (0, "bf16", False), (2, "bf16", False), (1, "bf16", True),
         (3, "fp32", False)]


def _engine(stage, precision, fp32_accum, clip=CLIP):
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "gradient_clipping": clip,
              "bf16": {"enabled": precision == "bf16"}}
    if fp32_accum:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                config=config)[0]


def _train(engine, rank, dtype, steps=STEPS, nan_at=None, sg=None):
    """Trains ``steps`` steps; the parameters after each, DeepSpeed's reported norm (None where
    it reports none: fp32 without ZeRO) and, guarded, the guard's norm."""
    params, norms, agreed = [], [], []
    for step in range(steps):
        x, y = _batch(step, rank, dtype)
        if step == nan_at:
            x[0, 0] = float("nan")
        engine.backward(nn.functional.mse_loss(engine(x).float(), y.float()))
        engine.step()
        params.append(_flat_params(engine.module))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        agreed.append(sg.last_report.grad_norm if sg is not None else None)
    return params, norms, agreed


def _twins_main(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for stage, precision, accum in TWINS:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        plain, plain_norms, _ = _train(_engine(stage, precision, accum), rank, dtype)
        engine = _engine(stage, precision, accum)
        sg = sg_deepspeed.guard_engine(engine, policy="default", framework_norm=True,
                                       collective_timeout=60)
        guarded, guarded_norms, agreed = _train(engine, rank, dtype, sg=sg)
        # The guard off (enabled=False): DeepSpeed's own step, bitwise, and no collective.
        engine = _engine(stage, precision, accum)
        off = sg_deepspeed.guard_engine(engine, policy="default", enabled=False)
        built = off.guard.stats().collective_calls
        off_params, off_norms, _ = _train(engine, rank, dtype, sg=off)
        out["%d-%s%s" % (stage, precision, "-fp32accum" if accum else "")] = {
            "off_same": [torch.equal(a, b) for a, b in zip(plain, off_params)],
            "off_same_norms": plain_norms == off_norms,
            "off_collectives": off.guard.stats().collective_calls - built,
            "optimizer": type(engine.optimizer).__name__,
            "same": [torch.equal(a, b) for a, b in zip(plain, guarded)],
            "same_norms": plain_norms == guarded_norms,
            "clipped": [n > CLIP for n in agreed],
            "applied": sg.guard.stats().totals.applied}
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


def test_framework_norm_with_a_binding_clip_is_bitwise_the_unguarded_twin():
    ranks = spawn_ranks(_twins_main, 2)
    for rank, out in enumerate(ranks):
        assert len(out) == len(TWINS)
        for key, run in out.items():
            assert all(run["clipped"]), (key, run)  # the clip binds on every step
            assert run["applied"] == STEPS, (key, run)
            assert all(run["same"]), (rank, key, run)
            assert run["same_norms"], (rank, key, run)  # DeepSpeed's own norm, logged
            assert all(run["off_same"]) and run["off_same_norms"], (rank, key, run)
            assert run["off_collectives"] == 0, (rank, key, run)
    optimizers = {key: run["optimizer"] for key, run in ranks[0].items()}
    assert optimizers == {"0-fp32": "AdamW", "0-bf16": "FP16_UnfusedOptimizer",
                          "2-bf16": "DeepSpeedZeroOptimizer", "1-bf16-fp32accum": "BF16_Optimizer",
                          "3-fp32": "DeepSpeedZeroOptimizer_Stage3"}, optimizers


def _identities(obj):
    return {name: id(value) for name, value in vars(obj).items()}


def _objects(engine):
    out = {"engine": engine, "optimizer": engine.optimizer, "basic": engine.basic_optimizer}
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None:
        out["loss_scaler"] = scaler
    return out


def _one_rank(port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")


def _vars_main(rank, world, port, out_dir):
    """Per layout: the attributes of DeepSpeed's objects that differ from an unguarded twin's
    after the same steps (the second one skipped: a NaN batch), and after detach() from before
    guard_engine."""
    _one_rank(port)
    declared = {seam.where.rsplit(".", 1)[1] for seam in _seams.SEAMS["deepspeed"]
                if seam.kind in ("writes", "replaces")}
    restored = {seam.where.rsplit(".", 1)[1] for seam in _seams.SEAMS["deepspeed"]
                if seam.kind in ("writes", "replaces") and seam.restored}
    out = {}
    for stage, precision, accum in TWINS:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        twin, engine = _engine(stage, precision, accum), _engine(stage, precision, accum)
        twin_before = {k: _identities(o) for k, o in _objects(twin).items()}
        before = {k: _identities(o) for k, o in _objects(engine).items()}
        sg = sg_deepspeed.guard_engine(engine, policy="default")
        _train(engine, 0, dtype, steps=3, nan_at=1, sg=sg)
        _train(twin, 0, dtype, steps=3)
        ours, undone = {}, {}
        for name, obj in _objects(engine).items():
            changed = {a for a in set(before[name]) | set(vars(obj))
                       if before[name].get(a) != _identities(obj).get(a)}
            twin_obj = _objects(twin)[name]
            own = {a for a in set(twin_before[name]) | set(vars(twin_obj))
                   if twin_before[name].get(a) != _identities(twin_obj).get(a)}
            # What DeepSpeed's own overflow path writes on the step it skipped (the twin applies
            # its steps: DeepSpeed checks no overflow in bf16 and fp32): the engine's count, ZeRO
            # 3's _overflow_clean_up a new dict of averaged gradients.
            own |= {"skipped_steps", "averaged_gradients"}
            ours[name] = sorted(changed - own - declared)
        outcome = [sg.guard.stats().totals.skipped, sg.last_report.outcome]
        sg.detach()
        for name, obj in _objects(engine).items():
            now = _identities(obj)
            undone[name] = sorted(a for a in restored if now.get(a) != before[name].get(a))
        # Detached, the engine steps unguarded: DeepSpeed's own methods, its counts.
        skipped = engine.skipped_steps
        _train(engine, 0, dtype, steps=1)
        out["%d-%s%s" % (stage, precision, "-fp32accum" if accum else "")] = {
            "undeclared": ours, "not_undone": undone, "last": outcome,
            "steps_after_detach": sg.guard.stats().step_count,
            "skipped_after_detach": engine.skipped_steps - skipped}
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


def test_guard_engine_touches_declared_seams_only_and_detach_puts_them_back():
    (out,) = spawn_ranks(_vars_main, 1)
    assert len(out) == len(TWINS)
    for key, run in out.items():
        assert run["last"] == [1, "applied"], (key, run)
        assert all(not v for v in run["undeclared"].values()), (key, run["undeclared"])
        assert all(not v for v in run["not_undone"].values()), (key, run["not_undone"])
        assert run["steps_after_detach"] == 3 and run["skipped_after_detach"] == 0, (key, run)


def _drift_main(rank, world, port, out_dir):
    _one_rank(port)
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    real = DeepSpeedZeroOptimizer.check_overflow

    def check_overflow(self, partition_gradients=True):  # a release that changed the method
        return real(self, partition_gradients)

    DeepSpeedZeroOptimizer.check_overflow = check_overflow
    out = {}
    try:
        engine = _engine(2, "fp32", False)
        try:
            sg_deepspeed.guard_engine(engine, policy="default")
            out["refused"] = None
        except RuntimeError as error:
            out["refused"] = str(error)
        out["untouched"] = "backward" not in vars(engine) and "step" not in vars(engine.optimizer)
        try:
            sg_deepspeed.guard_engine(engine, policy="default", framework_norm="yes",
                                      allow_untested_framework=True)
            out["bad_flag"] = None
        except TypeError as error:
            out["bad_flag"] = str(error)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sg = sg_deepspeed.guard_engine(engine, policy="default",
                                           allow_untested_framework=True)
        out["warned"] = [str(w.message) for w in caught if "relies on" in str(w.message)]
        _train(engine, 0, torch.float32, steps=2)
        out["applied"] = sg.guard.stats().totals.applied
    finally:
        DeepSpeedZeroOptimizer.check_overflow = real
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


def test_a_changed_deepspeed_function_is_refused_at_guard_engine_naming_it():
    (out,) = spawn_ranks(_drift_main, 1)
    name = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.check_overflow"
    assert out["refused"] and name in out["refused"], out
    assert "for a skipped step only" in out["refused"], out["refused"]  # what it is for
    assert out["untouched"], out
    assert len(out["warned"]) == 1 and name in out["warned"][0], out
    assert out["applied"] == 2, out
    assert "framework_norm must be a bool, got str" in out["bad_flag"], out

"""The deferred verdict inside the real torchtitan (0.3.0): ``StepguardConfig(deferred=True)`` on
torchtitan's default path, its fused AdamW (``optimizer.implementation='fused'``) stepped with
the guard's device flag, CUDA graphs left at torchtitan's default (eager on CPU, and
``zero_grad(set_to_none=False)``), FSDP2 on 2 CPU ranks with Gloo (titan_cpu.py).

Faults, as in test_torchtitan.py: a NaN in one element of rank 1's shard of a gradient (step 3), a
NaN loss on the last rank (step 5), a loss spike on every rank holding the loss (step 8); FSDP2
on 2 ranks, and pipeline parallel 2 x FSDP2 2 on 4 (1F1B, CUDA graphs off: torchtitan refuses them
with pipeline parallelism). Checked on every rank:
- the NaN steps skipped on the device at their step (parameters and AdamW state bitwise as
  before the step), their reports a step later (``report.deferred``), the tensor and the rank
  named; torchtitan logs NaN as the NaN step's norm and does not stop on the NaN loss;
- the spike applied, then rolled back inside the next step, bitwise to the snapshot, that step's
  batch dropped and the policy's batch drawn and dropped after it;
- the schedule steps once per update that stands (torchtitan's ``lr_schedulers.step()`` held
  until its step is decided);
- one guard collective per step, torchtitan's own norm never computed, the logged norm the
  agreed one (fp32).
Beside the synchronous guard on 4 clean steps with a binding clip (``max_norm`` 0.5): the
deferred run is bitwise the same (parameters, logged loss and norm), and with
``framework_norm=True`` (torchtitan's own norm and clip) bitwise an unguarded twin's. Resume (FSDP2): a deferred
run saved by torchtitan's checkpointer at step 3 (the step decided before the save) and resumed
ends bitwise as the uninterrupted one, the guard's totals included. A non-fused optimizer is
refused when the trainer is built, naming the setting.
"""

import math

import pytest
import torch
import torch.distributed as dist

import torchtitan  # noqa: F401  (a missing torchtitan fails the test)
from conftest import spawn_ranks
import test_torchtitan
from test_torchtitan import (CLEAN, NAN_GRAD, NAN_LOSS, SPIKE, STEPS, VICTIM, _build, _flat_params,
                             _flat_state, _local, _options)


def _default_path(trainer):
    assert not trainer.config.training.disable_cuda_graphs
    assert trainer.config.optimizer.implementation == "fused"
    container = trainer._containers[0] if hasattr(trainer, "_containers") else trainer.optimizers
    assert all(g["fused"] for o in container.optimizers for g in o.param_groups)


def _build_default(steps, folder, options, max_norm=1.0, pp=1, checkpoint_every=None):
    """torchtitan's default path: CUDA graphs on (eager on CPU), which torchtitan refuses under
    pipeline parallelism."""
    if pp > 1:
        return _build(steps, pp, folder, options, max_norm=max_norm)
    import titan_cpu
    real = titan_cpu.config

    def config(*args, **kwargs):
        cfg = real(*args, **kwargs)
        cfg.training.disable_cuda_graphs = False  # torchtitan's default (eager on CPU)
        return cfg
    titan_cpu.config = config
    try:
        trainer, logged = _build(steps, 1, folder, options, max_norm=max_norm,
                                 checkpoint_every=checkpoint_every)
    finally:
        titan_cpu.config = real
    _default_path(trainer)
    return trainer, logged


def _faults(folder, pp):
    from torchtitan.distributed import utils as dist_utils
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer, logged = _build_default(STEPS, folder, _options(deferred=True), pp=pp)
    named = dict(trainer.model_parts[0].named_parameters())
    holds_loss = not trainer.parallel_dims.pp_enabled or trainer.pp_has_last_stage

    def output_hook(module, args, output):
        if trainer.step == NAN_LOSS and rank == world - 1:
            return output * float("nan")
        return output * 30.0 if trainer.step == SPIKE else output
    if holds_loss:
        trainer.model_parts[-1].register_forward_hook(output_hook)
    real_fb = trainer.forward_backward_step

    def forward_backward_step(**kwargs):
        loss = real_fb(**kwargs)
        if trainer.step == NAN_GRAD and rank == 1:
            with torch.no_grad():
                _local(named[VICTIM].grad).view(-1)[0] = float("nan")
        return loss
    trainer.forward_backward_step = forward_backward_step
    framework_norms = []
    real_clip = dist_utils.clip_grad_norm_

    def counted_clip(*args, **kwargs):
        framework_norms.append(1)
        return real_clip(*args, **kwargs)
    dist_utils.clip_grad_norm_ = counted_clip
    reports, decided_in = [], {}
    real_resolved = trainer._resolved

    def resolved(report):
        if report is not None:
            decided_in[report.step] = trainer.step
            reports.append(report)
        return real_resolved(report)
    trainer._resolved = resolved
    schedule = trainer._containers[1].schedulers[0]
    ends, calls = {}, []
    real_step = trainer.train_step

    def train_step(data_iterator):
        before = (_flat_params(trainer), _flat_state(trainer))
        count = trainer.guard.stats().collective_calls
        real_step(data_iterator)
        now = (_flat_params(trainer), _flat_state(trainer))
        ends[trainer.step] = now
        calls.append({"step": trainer.step, "collectives":
                      trainer.guard.stats().collective_calls - count,
                      "unchanged": all(torch.equal(a, b) for a, b in zip(before, now)),
                      "logged": logged.get(trainer.step)})
    trainer.train_step = train_step
    first_epoch = schedule.last_epoch
    try:
        trainer.train()
    finally:
        dist_utils.clip_grad_norm_ = real_clip
    out = {"calls": calls, "framework_norms": len(framework_norms),
           "drawn": trainer.dataloader.position, "per_step": trainer._per_step,
           "schedule_steps": schedule.last_epoch - first_epoch, "reports": [],
           "holds_loss": holds_loss}
    for r in reports:
        incident = r.incident or {}
        restored = None
        if r.rolled_back:  # the guard's step k ran in torchtitan's step k (none dropped before)
            restored = all(torch.equal(a, b) for a, b in
                           zip(ends[decided_in[r.step]], ends[r.rolled_back_to]))
        out["reports"].append({
            "step": r.step, "outcome": r.outcome, "deferred": r.deferred,
            "decided_in": decided_in[r.step], "grad_norm": r.grad_norm, "restored": restored,
            "ranks": incident.get("ranks"), "tensors": incident.get("tensors")})
    trainer.close()
    return out


CLEAN_RUNS = {  # the guard's options of each clean run (None: unguarded)
    "deferred": dict(deferred=True), "synchronous": {},
    "deferred_framework_norm": dict(deferred=True, framework_norm=True), "twin": None}


def _clean(folder, name):
    options = CLEAN_RUNS[name]
    trainer, logged = _build_default(CLEAN, folder, None if options is None else _options(**options),
                                     max_norm=0.5)
    trainer.train()
    out = {"params": _flat_params(trainer).tolist(),
           "logged": [logged.get(s) for s in range(1, CLEAN + 1)]}
    trainer.close()
    return out


def _resume(folder, name):
    """test_torchtitan's resume runs under the deferred verdict: step 3 decided before
    torchtitan's checkpointer saves it (``first``), inside step 4 without a stop (``straight``)."""
    return test_torchtitan._resume(folder, name, lambda steps, every: _build_default(
        steps, folder, _options(deferred=True), checkpoint_every=every))


def _rank_main(rank, world, port, out_dir, run, folder, pp):
    import json
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import titan_cpu
    titan_cpu.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if run == "faults":
        result = _faults(folder, pp)
    elif run in ("first", "resumed", "straight"):
        result = _resume(folder, run)
    else:
        result = _clean(folder, run)
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(result, f, default=str)


def _run(run, folder, world=2, pp=1):
    return spawn_ranks(_rank_main, world, run, str(folder), pp, timeout=300)


def _check_faults(results, world):
    for rank, r in enumerate(results):
        assert r["framework_norms"] == 0, rank  # the clip's norm is the agreed one
        reports = {x["step"]: x for x in r["reports"]}
        calls = {c["step"]: c for c in r["calls"]}
        # torchtitan's steps 1..8 are the guard's 1..8; step 9 decides the spike and drops its
        # batch (no guard step); step 10 is the guard's step 9, decided at the end of the run.
        assert sorted(reports) == list(range(1, 10)), (rank, sorted(reports))
        assert all(x["deferred"] for x in reports.values()), rank
        for step in range(1, 9):
            assert reports[step]["decided_in"] == step + 1, (rank, reports[step])
        assert reports[9]["decided_in"] == STEPS, rank
        for step in (NAN_GRAD, NAN_LOSS):
            assert reports[step]["outcome"] == "skipped", (rank, reports[step])
            assert calls[step]["unchanged"], (rank, step)  # skipped on the device at its step
        assert any(VICTIM in t for t in reports[NAN_GRAD]["tensors"]), reports[NAN_GRAD]
        assert reports[NAN_LOSS]["ranks"] == [world - 1], reports[NAN_LOSS]
        spike = reports[SPIKE]
        assert not calls[SPIKE]["unchanged"], rank  # applied at its step: finite gradients
        assert spike["outcome"] == "rolled_back" and spike["restored"] is True, (rank, spike)
        applied = [x for x in reports.values() if x["step"] not in (NAN_GRAD, NAN_LOSS, SPIKE)]
        assert all(x["outcome"] == "applied" for x in applied), (rank, applied)
        assert r["schedule_steps"] == len(applied) == 6, (rank, r["schedule_steps"])
        # torchtitan's 10 batches, and the policy's one dropped after the rollback
        assert r["drawn"] == (STEPS + 1) * r["per_step"], rank
        for c in r["calls"]:  # (an incident decided in a step may gather rank rows too)
            decided = [x for x in reports.values() if x["decided_in"] == c["step"]]
            if c["step"] != SPIKE + 1 and all(x["outcome"] == "applied" for x in decided):
                assert c["collectives"] == 1, (rank, c)
        if not r["holds_loss"]:
            continue  # (torchtitan logs on the ranks holding the loss)
        assert math.isnan(calls[NAN_GRAD]["logged"][1]), calls[NAN_GRAD]
        assert calls[NAN_LOSS]["logged"] is None  # no log, and no stop: the step was skipped
        for step in range(1, SPIKE + 1):
            if step not in (NAN_GRAD, NAN_LOSS):
                assert calls[step]["logged"][1] == pytest.approx(reports[step]["grad_norm"],
                                                                 rel=1e-6), (rank, step)


def test_torchtitan_deferred_fsdp2(tmp_path):
    _check_faults(_run("faults", tmp_path / "faults"), 2)
    runs = {name: _run(name, tmp_path / name) for name in CLEAN_RUNS}
    for rank in range(2):
        deferred, synchronous = runs["deferred"][rank], runs["synchronous"][rank]
        assert deferred["params"] == synchronous["params"], rank
        assert deferred["logged"] == synchronous["logged"], rank
        assert min(norm for _, norm in deferred["logged"]) > 0.5  # the clip binds
        # With framework_norm, torchtitan's own norm and clip: bitwise the unguarded twin.
        own, twin = runs["deferred_framework_norm"][rank], runs["twin"][rank]
        assert own["params"] == twin["params"] and own["logged"] == twin["logged"], rank
    runs = {name: _run(name, tmp_path / ("straight" if name == "straight" else "resume"))
            for name in ("first", "resumed", "straight")}
    for rank in range(2):
        first, resumed, straight = (runs[n][rank] for n in ("first", "resumed", "straight"))
        assert first["step_count"] == 3 and not first["pending"], rank
        assert resumed["params"] == straight["params"], rank
        assert resumed["state"] == straight["state"], rank
        assert resumed["step_count"] == straight["step_count"] == 6, rank
        assert resumed["totals"] == straight["totals"], rank
        assert straight["totals"]["skipped"] == 1 and not straight["pending"], rank


def test_torchtitan_deferred_pipeline_x_fsdp2(tmp_path):
    _check_faults(_run("faults", tmp_path / "faults", world=4, pp=2), 4)


def test_torchtitan_deferred_needs_a_fused_optimizer():
    import titan_cpu
    titan_cpu.install()
    from stepguard.integrations.torchtitan import StepguardConfig, guarded
    config = titan_cpu.config(2)
    config.optimizer.implementation = "foreach"
    with pytest.raises(ValueError, match="optimizer.implementation='fused'.*got 'foreach'"):
        guarded(config, StepguardConfig(deferred=True)).build()
    config.optimizer.implementation = "fused_opt_states_bf16"
    with pytest.raises(ValueError, match="bf16 moments have not been run"):
        guarded(config, StepguardConfig(deferred=True)).build()

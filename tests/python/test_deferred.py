"""The deferred verdict (``deferred=True``) on the CPU, against the synchronous one on the same
faults: torch's fused AdamW skips on the device flag the guard hands it, at the same steps as the
synchronous verdict; rollbacks come one step later and restore the same bits; every step has its
report and its trace line; on 2 Gloo ranks a fault of one rank is skipped on both and named; and
what the deferred verdict cannot serve is refused with a message."""

import json
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stepguard
from stepguard import _C
from conftest import loss_of, make_model

# The default policy with a snapshot every 5 steps, so that a rollback has a target soon.
POLICY = _C.policy_presets()["default"].replace("snapshot_every: 50", "snapshot_every: 5")
STEPS = 16
NAN_GRAD, NAN_LOSS, BAD_STATE = 4, 7, 12


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(deferred, trace):
    """STEPS calls of step() with three faults; returns the reports in the order step() gave
    them (flush()'s last), and the parameters after each call."""
    model = make_model(21)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = stepguard.GuardedOptimizer(optimizer, model.named_parameters(), policy_yaml=POLICY,
                                       trace_path=trace, deferred=deferred)
    reports, after = [], []
    for call in range(1, STEPS + 1):
        guard.zero_grad()
        loss = loss_of(model, call)
        loss.backward()
        if call == NAN_GRAD:
            model[0].weight.grad[1, 2] = float("nan")
        if call == NAN_LOSS:
            loss = loss * float("nan")  # the gradients stay finite
        if call == BAD_STATE:
            with torch.no_grad():  # a bit flip in a second moment, before the update reads it
                optimizer.state[model[2].weight]["exp_avg_sq"].view(-1)[3] = float("nan")
        reports.append(guard.step(loss.detach()))
        after.append(_flat(model).clone())
    if deferred:
        reports.append(guard.flush())
        assert guard.flush() is None  # nothing waits any more
    return reports, after, guard


def _trace(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_deferred_verdict_skips_the_same_steps_and_rolls_back_a_step_later_to_the_same_bits():
    with tempfile.TemporaryDirectory() as d:
        sync, sync_after, sync_guard = _train(False, os.path.join(d, "sync.jsonl"))
        late, late_after, late_guard = _train(True, os.path.join(d, "late.jsonl"))
        sync_lines = _trace(os.path.join(d, "sync.jsonl"))
        late_lines = _trace(os.path.join(d, "late.jsonl"))
    # The synchronous verdict: each call's report is its own step's.
    assert [r.step for r in sync] == list(range(1, STEPS + 1))
    outcomes = {r.step: r.outcome for r in sync if not r.applied}
    assert outcomes == {NAN_GRAD: "skipped", NAN_LOSS: "skipped", BAD_STATE: "rolled_back"}
    assert sync[BAD_STATE - 1].rolled_back_to == 10
    # Deferred: each call returns the step before it, flush() the last; None where no step was
    # waiting (the first call, and the call after the one that rolled back, which began none).
    assert [i for i, r in enumerate(late) if r is None] == [0, BAD_STATE + 1]
    decided_steps = [r.step for r in late if r is not None]
    assert decided_steps == list(range(1, STEPS)) and all(r.deferred for r in late if r)
    # Up to the state fault the two runs are the same steps, bit for bit: the skips happened on
    # the device at their steps (fused AdamW with found_inf), the same reports came a call later.
    for step in range(1, BAD_STATE):
        assert torch.equal(late_after[step - 1], sync_after[step - 1]), step
        assert (late[step].outcome, late[step].grad_norm) == \
            (sync[step - 1].outcome, sync[step - 1].grad_norm), step
        assert (late[step].incident is None) == (sync[step - 1].incident is None), step
    for step in (NAN_GRAD, NAN_LOSS):
        assert late[step].incident["signal"] == sync[step - 1].incident["signal"]
        assert late[step].incident["tensors"] == sync[step - 1].incident["tensors"]
    # The bad state: skipped on the device at its step (no NaN reached the weights), rolled back
    # when the next call decided it, to the snapshot the synchronous run restored, bit for bit.
    assert torch.equal(late_after[BAD_STATE - 1], late_after[BAD_STATE - 2])
    assert torch.isfinite(late_after[BAD_STATE - 1]).all()
    decided = late[BAD_STATE]
    assert decided.step == BAD_STATE and decided.rolled_back and decided.rolled_back_to == 10
    assert decided.incident["signal"] == "optimizer_state"
    assert torch.equal(late_after[BAD_STATE], sync_after[BAD_STATE - 1])
    # That call's batch was run on the abandoned weights: dropped, counted as skipped data.
    assert late_guard.stats().skipped_ranges == [(BAD_STATE, 1)]
    assert late_guard.stats().data_position == sync_guard.stats().data_position
    # Every step has its trace line, marked deferred, with the same outcomes.
    assert [line["step"] for line in late_lines] == decided_steps
    assert all(line.get("deferred") is True for line in late_lines)
    assert not any("deferred" in line for line in sync_lines)
    assert [line["outcome"] for line in late_lines][:BAD_STATE] == \
        [line["outcome"] for line in sync_lines][:BAD_STATE]
    totals = late_guard.stats().totals.to_dict()
    assert (totals["steps"], totals["skipped"], totals["rolled_back"]) == (STEPS - 1, 2, 1), totals


def test_a_skip_decided_on_the_host_comes_too_late_and_is_recorded_as_applied(capfd):
    # A rule that skips a finite step (a grad-norm spike) needs the host: under the deferred
    # verdict the update has run by then, and the report and stderr say so.
    policy = """version: 1
detectors:
  grad_norm_spike: {z: 4, warmup: 20, decay: 0.95, early_factor: 15}
rules:
  - {name: skip-spike, on: grad_norm_spike, action: skip_batch}
"""
    model = make_model(22)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, fused=True),
                                       model.named_parameters(), policy_yaml=policy,
                                       deferred=True)
    before = None
    for call in range(1, 8):
        guard.zero_grad()
        loss_of(model, call).backward()
        if call == 7:
            for p in model.parameters():
                p.grad.mul_(1e4)  # finite: nothing for the device to skip
            before = _flat(model).clone()
        guard.step()
    assert not torch.equal(_flat(model), before)  # the spike's update ran
    report = guard.flush()
    assert report.step == 7 and report.applied and report.deferred
    assert report.incident["signal"] == "grad_norm_spike"
    assert "decided after the update ran (deferred verdict)" in report.incident["reason"]
    assert "the deferred verdict skipped an update that had already run" in capfd.readouterr().err


def test_what_the_deferred_verdict_cannot_serve_is_refused_with_a_message():
    model = make_model(23)
    with pytest.raises(ValueError, match="fused=True; AdamW does not take one"):
        stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   model.named_parameters(), deferred=True)
    # Fused in every param group (as torchtitan builds its optimizers) takes the flag too; a
    # group left unfused does not.
    groups = [{"params": [p], "fused": True} for p in model.parameters()]
    per_group = stepguard.GuardedOptimizer(torch.optim.AdamW(groups, lr=1e-2), deferred=True)
    loss_of(model, 0).backward()
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    before = _flat(model).clone()
    per_group.step()
    assert torch.equal(_flat(model), before)  # skipped on the device flag
    assert per_group.flush().outcome == "skipped"
    model.zero_grad()
    groups[-1]["fused"] = None
    with pytest.raises(ValueError, match="AdamW does not take one"):
        stepguard.GuardedOptimizer(torch.optim.AdamW(groups, lr=1e-2), deferred=True)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with pytest.raises(ValueError, match="with a loss scaler"):
        stepguard.GuardedOptimizer(fused, model.named_parameters(), deferred=True,
                                   grad_scaler=torch.amp.GradScaler("cpu"))
    guard = stepguard.GuardedOptimizer(fused, model.named_parameters(), deferred=True)
    with pytest.raises(RuntimeError, match="verdict\\(\\) of a guard built with deferred=True"):
        guard.verdict()
    guard.set_replay(lambda mode: loss_of(model, 0))
    guard.zero_grad()
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match="deferred=True with set_replay"):
        guard.step()
    guard.set_replay(None)
    assert guard.step() is None  # nothing changed by the refusal: the step runs now
    # The state dict decides the waiting step first, and round-trips.
    state = guard.state_dict()
    assert state["stepguard"]["step"] == 1 and guard.flush() is None
    guard.load_state_dict(state)
    # A GradScaler stepping it is refused as for any guard not given the scaler.
    guard.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model, 1)).backward()
    with pytest.raises(ValueError, match="GuardedOptimizer\\(..., grad_scaler=scaler\\)"):
        scaler.step(guard)


def _deferred_rank(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    model = make_model(24)
    guard = stepguard.GuardedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model.named_parameters(),
        process_group=dist.group.WORLD, collective_timeout=60, deferred=True)
    reports = []
    for call in range(1, 7):
        guard.zero_grad()
        loss_of(model, 10 * call + rank).backward()
        for p in model.parameters():  # DDP's average, by hand
            dist.all_reduce(p.grad)
            p.grad /= world
        if call == 3 and rank == 1:
            model[2].bias.grad[0] = float("inf")  # after the average: rank 1's alone
        reports.append(guard.step())
    reports.append(guard.flush())
    torch.save({"reports": [None if r is None else (r.step, r.outcome,
                                                   r.incident and r.incident["ranks"])
                            for r in reports],
                "params": _flat(model)},
               os.path.join(out_dir, "rank%d.pt" % rank))
    dist.barrier()
    dist.destroy_process_group()


def test_on_two_ranks_a_fault_of_one_is_skipped_on_both_at_its_step_and_named():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_deferred_rank, args=(2, os.path.join(d, "init"), d), nprocs=2)
        ranks = [torch.load(os.path.join(d, "rank%d.pt" % r)) for r in range(2)]
    for out in ranks:
        assert out["reports"][0] is None
        assert out["reports"][1:] == [(1, "applied", None), (2, "applied", None),
                                      (3, "skipped", [1]), (4, "applied", None),
                                      (5, "applied", None), (6, "applied", None)], out
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])  # the replicas stayed one
    assert math.isfinite(float(ranks[0]["params"].sum()))

"""A guard that is off (``enabled=False``, GradScaler's switch): the wrapped optimizer steps as
without it, bitwise, with no collective per step, beside a GradScaler as a plain optimizer, and
the guard's state round-trips through the state dict."""

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stepguard
from conftest import loss_of, make_model
from test_grad_scaler import _flat, _loop, _scaler

STEPS = 6


def _run(stepper, model, steps=STEPS, first=0):
    reports = []
    for step in range(first, first + steps):
        stepper.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        guarded = isinstance(stepper, stepguard.GuardedOptimizer)
        reports.append(stepper.step(loss.detach()) if guarded else stepper.step())
    return reports


def test_a_guard_that_is_off_steps_bitwise_as_the_plain_optimizer():
    plain_model = make_model(5)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    _run(plain, plain_model)
    model = make_model(5)
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       model.named_parameters(), enabled=False,
                                       policy="default", metrics_port=0)
    assert guard.enabled is False
    reports = _run(guard, model)
    assert torch.equal(_flat(model), _flat(plain_model))
    assert [r.step for r in reports] == list(range(1, STEPS + 1))
    assert all(r.applied and math.isnan(r.grad_norm) and r.loss is None for r in reports)
    stats = guard.stats()
    assert stats.totals.to_dict()["applied"] == STEPS and stats.totals.to_dict()["snapshots"] == 0
    assert stats.metrics_endpoint == ""  # no endpoint served
    # A NaN gradient is applied, as the plain optimizer applies it: the guard looks at nothing.
    guard.zero_grad()
    loss = loss_of(model, 99)
    loss.backward()
    model[0].bias.grad[0] = float("nan")
    assert guard.step(loss).applied and not torch.isfinite(model[0].bias).all()
    with pytest.raises(TypeError):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), enabled="no")


def test_the_state_dict_round_trips_through_a_guard_that_is_off():
    model = make_model(6)
    on = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    model.named_parameters())
    _run(on, model, steps=3)
    saved = on.state_dict()
    off = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     model.named_parameters(), enabled=False)
    off.load_state_dict(saved)
    _run(off, model, steps=2, first=3)
    again = off.state_dict()
    # The decision state is the guard's as it was; the step count and data position went on.
    assert again["stepguard"]["guard"] == saved["stepguard"]["guard"]
    assert again["stepguard"]["step"] == saved["stepguard"]["step"] + 2
    back = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      model.named_parameters())
    back.load_state_dict(again)
    assert _run(back, model, steps=1, first=5)[0].step == 6


def test_a_guard_that_is_off_under_a_grad_scaler_is_the_plain_scaler_loop():
    """The scaler skips the overflow and NaN steps itself and backs off, as for the plain
    optimizer: the scale trajectory and the parameters are the twin's, bit for bit."""
    twin = make_model(3)
    twin_scales, _ = _loop(twin, torch.optim.AdamW(twin.parameters(), lr=1e-2), _scaler(),
                           guarded=False)
    model = make_model(3)
    scaler = _scaler()
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       model.named_parameters(), grad_scaler=scaler,
                                       enabled=False)
    scales, reports = _loop(model, guard, scaler, guarded=True)
    assert scales == twin_scales
    assert torch.equal(_flat(model), _flat(twin))
    assert sum(r is None for r in reports) == 3  # the scaler left out the guard's step


def _off_rank(rank, world, init_file, out_dir, enabled):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    model = make_model(12)
    try:
        guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           model.named_parameters(), process_group=dist.group.WORLD,
                                           collective_timeout=60, enabled=enabled[rank])
    except RuntimeError as e:
        torch.save({"error": str(e)}, os.path.join(out_dir, "rank%d.pt" % rank))
        dist.destroy_process_group()
        return
    built = guard.stats().collective_calls
    # Rank 1 never steps: a guard that made a collective per step would wait for it.
    reports = _run(guard, model, steps=4) if rank == 0 else []
    torch.save({"built": built, "after": guard.stats().collective_calls,
                "outcomes": [r.outcome for r in reports]},
               os.path.join(out_dir, "rank%d.pt" % rank))
    dist.barrier()
    dist.destroy_process_group()


def _ranks(enabled):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_off_rank, args=(2, os.path.join(d, "init"), d, enabled), nprocs=2)
        return [torch.load(os.path.join(d, "rank%d.pt" % r)) for r in range(2)]


def test_a_guard_that_is_off_makes_no_collective_per_step():
    rank0, rank1 = _ranks([False, False])
    assert rank0["outcomes"] == ["applied"] * 4
    assert rank0["after"] == rank0["built"], rank0


def test_the_ranks_must_agree_on_enabled():
    for out in _ranks([True, False]):
        assert "enabled (rank 0: 1, rank 1: 0)" in out["error"], out

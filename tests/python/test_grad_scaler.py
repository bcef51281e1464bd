"""PyTorch's own fp16 recipe stepping a guard: ``scaler.scale(loss).backward();
scaler.step(guard, loss); scaler.update()`` with a real ``torch.amp.GradScaler`` ("cpu"), each
run beside an unguarded twin (the same loop stepping the plain optimizer), in one process and on
2 Gloo ranks under DDP. The gradients are fp32 (CPU autocast to fp16 depends on the CPU's
kernels); an overflow is an Inf planted in the scaled gradients after backward, as an fp16
backward would leave it."""

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stepguard
from conftest import loss_of, make_model

STEPS = 12
INF_AT = (4, 5)      # overflows: the scaler backs off twice
NAN_LOSS_AT = 8      # a NaN loss: NaN gradients too, skipped, the scaler backs off


def _scaler():
    # growth_interval 3: the scale grows inside the run, so the trajectory is a real check.
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)


def _loop(model, stepper, scaler, guarded, unscale_and_clip=False, faults=True, steps=STEPS):
    """The recipe, ``steps`` times; returns each step's scale after update() and the reports."""
    scales, reports = [], []
    for step in range(steps):
        stepper.zero_grad()
        loss = loss_of(model, step)
        if faults and step == NAN_LOSS_AT:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        if faults and step in INF_AT:
            model[0].weight.grad[0, 0] = float("inf")
        if unscale_and_clip:
            scaler.unscale_(stepper)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        out = scaler.step(stepper, loss.detach()) if guarded else scaler.step(stepper)
        scaler.update()
        scales.append(scaler.get_scale())
        reports.append(out)
    return scales, reports


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _pair(**loop):
    twin = make_model(3)
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_scales, _ = _loop(twin, opt, _scaler(), guarded=False, **loop)
    model = make_model(3)
    scaler = _scaler()
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       model.named_parameters(), grad_scaler=scaler,
                                       policy="default")
    scales, reports = _loop(model, guard, scaler, guarded=True, **loop)
    return (twin, twin_scales), (model, scales, reports, guard)


@pytest.mark.parametrize("unscale_and_clip", [False, True], ids=["plain", "unscale_clip"])
def test_the_guard_sees_every_step_the_scaler_would_leave_out_and_steps_as_the_twin(
        unscale_and_clip):
    (twin, twin_scales), (model, scales, reports, guard) = _pair(
        unscale_and_clip=unscale_and_clip)
    # The scaler's own rules: the same scale after every step, the same weights bit for bit.
    assert scales == twin_scales
    assert scales[INF_AT[0]] == scales[INF_AT[0] - 1] / 2, scales
    assert torch.equal(_flat(model), _flat(twin))
    # Every step reached the guard: the overflows are the `overflow` signal, only skipped; the
    # NaN loss is named as one; the guard's count is the loop's.
    for step, report in enumerate(reports):
        assert isinstance(report, stepguard.StepReport) and report.step == step + 1
        if step in INF_AT:
            assert report.outcome == "skipped" and report.incident["signal"] == "overflow"
            assert report.incident["tensors"] == ["0.weight"], report.incident
        elif step == NAN_LOSS_AT:
            assert report.outcome == "skipped", report
            assert report.incident["signal"] == "nonfinite_loss", report.incident
        else:
            assert report.applied, (step, report)
        assert report.loss_scale == (twin_scales[step - 1] if step else 2.0 ** 12)
    stats = guard.stats()
    assert stats.step_count == STEPS
    assert stats.totals.skipped == len(INF_AT) + 1 and stats.totals.applied == STEPS - 3
    # The scaler's attributes for the optimizer are gone after each step, as GradScaler leaves
    # an optimizer of its own seam.
    assert "found_inf" not in vars(guard) and "grad_scale" not in vars(guard)


def test_a_guarded_step_reads_nothing_from_python_where_the_scaler_step_reads_once():
    """The scaler's own step reads its found-inf flag; the guarded one reads neither it nor the
    scale from Python (no get_scale(), no item() or float() of a tensor): the scale rides in the
    step buffer and arrives with the guard's one read of it in C++, and the guard skips on the
    agreed verdict."""
    def count(stepper, guarded, model, scaler):
        loss = loss_of(model, 0)
        scaler.scale(loss).backward()
        calls = []
        real = {name: getattr(torch.Tensor, name) for name in ("item", "__float__")}
        get_scale = torch.amp.GradScaler.get_scale
        for name, f in real.items():
            setattr(torch.Tensor, name, lambda self, _f=f, _n=name: calls.append(_n) or _f(self))
        torch.amp.GradScaler.get_scale = lambda self: calls.append("get_scale") or get_scale(self)
        try:
            report = scaler.step(stepper, loss.detach()) if guarded else scaler.step(stepper)
        finally:
            for name, f in real.items():
                setattr(torch.Tensor, name, f)
            torch.amp.GradScaler.get_scale = get_scale
        scaler.update()
        return calls, report

    # SGD: AdamW on CPU reads its step counters to the host, as much guarded as not.
    twin = make_model(3)
    plain, _ = count(torch.optim.SGD(twin.parameters(), lr=1e-2), False, twin, _scaler())
    model = make_model(3)
    scaler = _scaler()
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2),
                                       model.named_parameters(), grad_scaler=scaler)
    guarded, report = count(guard, True, model, scaler)
    assert plain == ["item"] and guarded == [], (plain, guarded)
    assert report.applied and report.loss_scale == 2.0 ** 12  # the scale, agreed


def test_a_guard_stepped_by_a_scaler_it_was_not_given_refuses_the_step_and_changes_nothing():
    model = make_model(3)
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       model.named_parameters())
    scaler = _scaler()
    scaler.scale(loss_of(model, 0)).backward()
    before = _flat(model).clone()
    with pytest.raises(ValueError, match=r"grad_scaler=scaler"):
        scaler.step(guard)
    assert torch.equal(_flat(model), before) and guard.stats().step_count == 0
    assert "found_inf" not in vars(guard) and "grad_scale" not in vars(guard)
    # A disabled scaler calls the plain step: nothing to refuse.
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert off.step(guard).applied


def test_what_cannot_be_a_guards_scaler_is_refused_naming_it():
    model = make_model(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        stepguard.GuardedOptimizer(opt, grad_scaler=object())
    with pytest.raises(ValueError, match="two owners of one loss scale"):
        stepguard.GuardedOptimizer(opt, grad_scaler=_scaler(), loss_scaling=True)
    with pytest.raises(ValueError, match="not both"):
        stepguard.GuardedOptimizer(opt, grad_scaler=_scaler(),
                                   port=stepguard.TorchOptimPort(opt))
    # A closure would run its backward after the scaler's unscale: refused before anything.
    guard = stepguard.GuardedOptimizer(opt, model.named_parameters(), grad_scaler=_scaler())
    before = _flat(model)
    with pytest.raises(TypeError, match="a closure with grad_scaler"):
        guard.step(lambda: model(torch.ones(2, 8)).sum())
    assert torch.equal(_flat(model), before) and guard.stats().step_count == 0


def test_a_changed_grad_scaler_is_refused_at_construction(monkeypatch):
    from stepguard.integrations import _seams
    monkeypatch.setitem(_seams.TESTED_SOURCES["torch"],
                        "torch.amp.grad_scaler.GradScaler.update", frozenset({"0" * 16}))
    model = make_model(3)
    with pytest.raises(RuntimeError, match=r"GradScaler.update: its code differs"):
        stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   grad_scaler=_scaler())
    # The way past it the message names: a warning, and the guard is built.
    with pytest.warns(RuntimeWarning, match="allow_untested_framework=True: running anyway"):
        stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   grad_scaler=_scaler(), allow_untested_framework=True)


# -- 2 Gloo ranks under DDP --------------------------------------------------------------------
RANK_INF_AT = 3      # an Inf on rank 1 alone, after DDP's all-reduce (a fault of that rank)
RANK_NAN_AT = 6      # a NaN loss on rank 0 alone (DDP carries its NaN gradients to rank 1)


def _rank_main(rank, world, init_file, out_dir, guarded):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    model = make_model(5)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = _scaler()
    stepper = (stepguard.GuardedOptimizer(opt, model.named_parameters(), grad_scaler=scaler,
                                          process_group=dist.group.WORLD, policy="default",
                                          collective_timeout=60) if guarded else opt)
    rows = []
    for step in range(10):
        stepper.zero_grad()
        loss = loss_of(ddp, 100 * rank + step)
        if step == RANK_NAN_AT and rank == 0:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        if step == RANK_INF_AT and rank == 1:
            model[2].bias.grad[0] = float("inf")
        calls = stepper.stats().collective_calls if guarded else 0
        out = scaler.step(stepper, loss.detach()) if guarded else scaler.step(stepper)
        scaler.update()
        row = {"scale": scaler.get_scale()}
        if guarded:
            row.update(outcome=out.outcome, incident=out.incident,
                       collectives=stepper.stats().collective_calls - calls)
        rows.append(row)
    torch.save({"rows": rows, "params": _flat(model)}, os.path.join(out_dir, "rank%d.pt" % rank))
    dist.destroy_process_group()


def _ranks(guarded):
    world = 2
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank_main, args=(world, os.path.join(d, "init"), d, guarded),
                           nprocs=world, start_method="spawn", join=True)
        return [torch.load(os.path.join(d, "rank%d.pt" % r)) for r in range(world)]


def test_two_ranks_skip_a_fault_of_either_and_every_scaler_backs_off_alike():
    guarded = _ranks(True)
    twin = _ranks(False)
    for r in guarded:
        outcomes = [row["outcome"] for row in r["rows"]]
        assert outcomes == ["skipped" if s in (RANK_INF_AT, RANK_NAN_AT) else "applied"
                            for s in range(10)], outcomes
        inf, nan = r["rows"][RANK_INF_AT]["incident"], r["rows"][RANK_NAN_AT]["incident"]
        assert inf["signal"] == "overflow" and inf["ranks"] == [1], inf
        assert nan["signal"] == "nonfinite_loss" and nan["ranks"] == [0], nan
        clean = [row["collectives"] for s, row in enumerate(r["rows"])
                 if s not in (RANK_INF_AT, RANK_NAN_AT)]
        assert set(clean) == {1}, clean  # one collective per clean step
    # The Inf of rank 1 alone backs off both ranks' scalers: the scales never part, and the
    # replicas stay equal.
    scales = [[row["scale"] for row in r["rows"]] for r in guarded]
    assert scales[0] == scales[1], scales
    assert scales[0][RANK_INF_AT] == scales[0][RANK_INF_AT - 1] / 2
    assert torch.equal(guarded[0]["params"], guarded[1]["params"])
    # Unguarded, the same fault leaves the scales apart (rank 1 backs off, rank 0 grows on),
    # and rank 0 applies the step rank 1 skipped: what the guard prevents.
    twin_scales = [[row["scale"] for row in r["rows"]] for r in twin]
    assert twin_scales[0] != twin_scales[1]
    assert not torch.equal(twin[0]["params"], twin[1]["params"])
    assert all(math.isfinite(x) for x in scales[0])

"""stepguard.GuardedOptimizer over torch.optim: the guarded step, pass-through, rollback for every
common optimizer, state dicts, errors. Expected values are computed independently (the plain
optimizer's own steps)."""

import io

import pytest
import torch

import stepguard
from conftest import clone_state, loss_of, make_model, same_state

ROLLBACK_POLICY = """version: 1
checkpoint: {snapshot_every: 1, snapshot_keep: 2}
rules:
  - {on: nonfinite_loss, action: rollback, skip_batches: 2}
  - {on: nonfinite_grad, action: skip_batch}
"""


def test_clean_steps_match_the_plain_optimizer_bitwise():
    a, b = make_model(1), make_model(1)
    plain = torch.optim.AdamW(a.parameters(), lr=1e-2)
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-2),
                                       b.named_parameters())
    for step in range(5):
        plain.zero_grad()
        loss_of(a, step).backward()
        plain.step()
        guard.zero_grad()
        loss = loss_of(b, step)
        loss.backward()
        report = guard.step(loss)
        assert report.applied and report.outcome == "applied" and report.step == step + 1
        assert report.actions == ["apply"] and report.incident is None
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert guard.stats().collective_calls == 5 and guard.stats().step_count == 5


def test_a_nan_gradient_is_skipped_named_and_the_scheduler_waits():
    model = make_model(2)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(guard, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    guard.zero_grad()
    loss = loss_of(model, 0)
    loss.backward()
    model[2].weight.grad[0, 0] = float("nan")
    report = guard.step(loss)
    if report.applied:
        sched.step()
    assert report.skipped and not report.applied and report.outcome == "skipped"
    assert report.nonfinite_count == 1
    assert report.incident["signal"] == "nonfinite_grad"
    assert report.incident["action"] == "skip_batch"
    assert report.incident["tensors"] == ["2.weight"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert guard.param_groups[0]["lr"] == 0.1  # the scheduler did not step
    assert guard.stats().totals.skipped == 1


def test_accepted_wherever_the_optimizer_is():
    model = make_model(3)
    inner = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    guard = stepguard.GuardedOptimizer(inner)
    assert isinstance(guard, torch.optim.Optimizer)
    assert guard.param_groups is inner.param_groups and guard.state is inner.state
    assert guard.defaults is inner.defaults
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(guard, T_max=10)
    for step in range(3):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        if guard.step(loss).applied:
            sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + torch.cos(
        torch.tensor(3 * torch.pi / 10)).item()))


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=1e-2),
    lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    lambda p: torch.optim.Adagrad(p, lr=0.05),
], ids=["sgd_momentum", "adam", "adamw_amsgrad", "rmsprop", "adagrad"])
def test_rollback_restores_parameters_and_state_bitwise(make_optimizer):
    model = make_model(4)
    opt = make_optimizer(model.parameters())
    guard = stepguard.GuardedOptimizer(opt, model.named_parameters(), policy_yaml=ROLLBACK_POLICY)
    for step in range(1, 4):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        assert guard.step(loss).applied
        if step == 2:
            params_at_2 = [p.detach().clone() for p in model.parameters()]
            state_at_2 = clone_state(opt)
    # Step 4's NaN loss discards step 3's snapshot (unconfirmed) and rolls back to step 2's.
    guard.zero_grad()
    loss = loss_of(model, 4) * float("nan")
    loss.backward()
    report = guard.step(loss)
    assert report.rolled_back and report.rolled_back_to == 2 and report.batches_to_skip == 2
    for p, q in zip(model.parameters(), params_at_2):
        assert torch.equal(p, q)
    assert same_state(opt, state_at_2)
    assert guard.stats().data_position == 4 + 2
    guard.zero_grad()
    loss = loss_of(model, 5)
    loss.backward()
    assert guard.step(loss).applied


def test_state_dict_continues_the_run_exactly():
    def run(model, guard, steps):
        for step in steps:
            guard.zero_grad()
            loss = loss_of(model, step)
            loss.backward()
            guard.step(loss)

    a = make_model(5)
    ga = stepguard.GuardedOptimizer(torch.optim.Adam(a.parameters(), lr=1e-2),
                                    policy_yaml=ROLLBACK_POLICY, loss_scaling=False)
    run(a, ga, range(4))
    buffer = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": ga.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    b = make_model(99)
    gb = stepguard.GuardedOptimizer(torch.optim.Adam(b.parameters(), lr=1e-2),
                                    policy_yaml=ROLLBACK_POLICY)
    b.load_state_dict(saved["model"])
    gb.load_state_dict(saved["optim"])
    assert gb.stats().step_count == 4 and gb.stats().data_position == ga.stats().data_position
    run(a, ga, range(4, 8))
    run(b, gb, range(4, 8))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert gb.stats().totals.to_dict() == ga.stats().totals.to_dict()


def test_a_bad_loss_raises_and_changes_nothing():
    model = make_model(6)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    guard.zero_grad()
    loss_of(model, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(stepguard.StepguardError, match="loss must be a scalar"):
        guard.step(torch.ones(2))
    with pytest.raises(stepguard.StepguardError, match="floating-point"):
        guard.step(torch.tensor(1))
    with pytest.raises(TypeError, match="takes the loss tensor, a closure or nothing, got str"):
        guard.step("loss")
    assert guard.stats().step_count == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_policy_errors_keep_their_positions():
    model = make_model(7)
    with pytest.raises(stepguard.StepguardError) as e:
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   policy_yaml="version: 1\nlimits: {max_bad: 1}\n")
    assert str(e.value) == ("policy_yaml:2:10: unknown key 'max_bad' in 'limits' (known: "
                            "max_consecutive_bad_steps, max_skips, max_rollbacks, "
                            "loss_scale_floor)")
    with pytest.raises(TypeError, match="unknown option"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), trace="x")


def test_loss_scaling_unscales_in_place_and_backs_off():
    model = make_model(8)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       loss_scaling=True)
    assert guard.stats().loss_scale == 65536.0
    guard.zero_grad()
    loss = loss_of(model, 0)
    guard.scale_loss(loss).backward()
    scaled = model[0].weight.grad.clone()
    report = guard.step(loss)
    assert report.applied
    assert torch.allclose(model[0].weight.grad, scaled / 65536.0)
    guard.zero_grad()
    loss = loss_of(model, 1)
    guard.scale_loss(loss).backward()
    model[0].weight.grad[0, 0] = float("inf")
    report = guard.step(loss)
    assert report.skipped and "drop_loss_scale" in report.actions
    assert guard.stats().loss_scale == 32768.0


def test_forensics_replay_names_a_hardware_suspect():
    model = make_model(9)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []

    def replay(mode):
        calls.append(mode)
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    guard.set_replay(replay)
    guard.zero_grad()
    loss = loss_of(model, 0)
    loss.backward()
    model[0].weight.grad[1, 1] = float("nan")  # transient: the replay is clean
    report = guard.step(loss)
    assert calls == ["as_is"]
    assert report.incident["cause"] == "hardware_suspect"
    guard.set_replay(None)


def test_check_inputs_names_a_data_cause():
    model = make_model(10)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(5, 8)
    x[2, 3] = float("nan")
    verdict = guard.check_inputs([x])
    assert not verdict
    assert verdict.problems == ["input 0 holds 1 NaN value"]
    x_inf = x.clone()
    x_inf[0, :2] = float("inf")
    assert guard.check_inputs([x_inf]).problems == ["input 0 holds 1 NaN and 2 Inf values"]
    assert guard.check_inputs([torch.ones(2)])
    guard.check_inputs([x])  # the verdict of the last call counts, asked or not
    guard.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), torch.zeros(5, 4))
    loss.backward()
    report = guard.step(loss)
    assert report.incident["cause"] == "data"
    assert any("input 0 holds 1 NaN value" in line for line in report.incident["evidence"])


def test_a_snapshot_that_cannot_be_taken_is_counted_and_training_goes_on(capfd):
    """Optimizer state that cannot be copied (here: an entry pickle refuses) fails one RAM
    snapshot: the step stands, the older snapshots stay and a rollback goes to one of them."""
    model = make_model(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guard = stepguard.GuardedOptimizer(opt, model.named_parameters(), policy_yaml=ROLLBACK_POLICY,
                                       metrics_port=0)
    first = next(iter(model.parameters()))
    for step in range(1, 4):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        if step == 3:
            params_at_2 = [p.detach().clone() for p in model.parameters()]
            opt.state[first]["note"] = lambda: None  # pickle cannot copy a lambda
        assert guard.step(loss).applied
    err = capfd.readouterr().err
    assert "step 3: the RAM snapshot could not be taken (" in err, err
    assert "training goes on" in err
    text = guard.metrics_text()
    line = [l for l in text.splitlines() if l.startswith("stepguard_snapshot_failures_total")]
    assert line and float(line[0].split()[-1]) == 1.0, line
    del opt.state[first]["note"]
    guard.zero_grad()
    loss = loss_of(model, 4) * float("nan")
    loss.backward()
    report = guard.step(loss)
    assert report.outcome == "rolled_back" and report.rolled_back_to == 2, report
    for p, saved in zip(model.parameters(), params_at_2):
        assert torch.equal(p.detach(), saved)


def test_a_replay_given_the_model_names_the_first_bad_module_and_hooks_nothing_else():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    x = torch.randn(5, 8)
    poison = {"on": False}

    def nan_in_tanh(_module, _inputs, output):
        if poison["on"]:
            output = output.clone()
            output[0, 0] = float("nan")
        return output
    model[1].register_forward_hook(nan_in_tanh)

    def replay(mode):
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        guard.set_replay(replay, model=object())
    guard.set_replay(replay, model=model)
    assert all(not m._forward_hooks for m in (model[0], model[2]))  # nothing on normal steps
    poison["on"] = True
    guard.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    report = guard.step(loss)
    assert report.incident["cause"] == "forward"
    assert "the first non-finite output in forward order: 1" in report.incident["evidence"]
    assert all(not m._forward_hooks for m in (model[0], model[2]))

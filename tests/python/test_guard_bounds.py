"""The guard's own promises under a careless or hostile user (the fifth trust round): a step
reported clean never writes non-finite weights, a decoded state never drives the arithmetic past
its bounds, the two phases refuse what may not run between them, and a parameter list the norm
would count wrongly is refused. One process, CPU."""

import struct

import pytest
import torch

import stepguard
from conftest import loss_of, make_model

SKIP_ONLY = "version: 1\nrules:\n  - {on: nonfinite, action: skip_batch}\n"
MIN_USABLE_SCALE = 2.0 ** -126  # below it the scale's fp32 inverse is Inf


def _bits(value):
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _finite(model):
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _scaled_guard(model, **options):
    return stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                      model.named_parameters(), loss_scaling=True,
                                      policy_yaml=SKIP_ONLY, **options)


def test_a_long_overflow_streak_never_leaves_a_scale_that_writes_nan_weights():
    # GradScaler's rule has no floor: 150 overflow steps halved 2^16 to 2^-134, whose fp32
    # inverse is Inf; the next clean step was reported applied with nonfinite_count 0 and wrote
    # NaN into the weights. The scale now stops at 2^-126.
    model = make_model(3)
    guard = _scaled_guard(model)
    for step in range(150):
        guard.zero_grad()
        guard.scale_loss(loss_of(model, step)).backward()
        model[0].weight.grad[0, 0] = float("inf")
        assert guard.step(loss_of(model, step)).skipped
    assert guard.stats().loss_scale == MIN_USABLE_SCALE
    guard.zero_grad()
    loss = loss_of(model, 150)
    guard.scale_loss(loss).backward()
    report = guard.step(loss)
    assert report.applied and report.nonfinite_count == 0, report
    assert _finite(model)


def test_the_unscaled_gradients_applied_are_the_ones_inspected():
    # A finite scaled gradient whose unscaled value is past fp32's largest: the fp64 check
    # called it finite, the fp32 unscale wrote Inf, the step was applied. Now it is an overflow.
    model = make_model(4)
    guard = _scaled_guard(model)
    guard.zero_grad()
    guard.scale_loss(loss_of(model, 0)).backward()
    model[0].weight.grad[0, 0] = 3e38  # times 1/65536 is fine; the point is the next line
    state = guard.guard_state_dict()
    state["guard"][-10] = _bits(1e-10)  # a scale the scaler can reach
    guard.load_guard_state_dict(state)
    report = guard.step(loss_of(model, 0))
    assert report.skipped and report.nonfinite_count >= 1, report
    assert _finite(model)


@pytest.mark.parametrize("scale", [1e-300, 5e-324, 1e300, float("inf"), 0.0])
def test_a_saved_loss_scale_whose_inverse_is_no_finite_float_is_refused(scale):
    model = make_model(5)
    guard = _scaled_guard(model)
    state = guard.guard_state_dict()
    state["guard"][-10] = _bits(scale)
    with pytest.raises(RuntimeError, match="the saved scale"):
        guard.load_guard_state_dict(state)
    assert guard.stats().loss_scale == 65536.0
    guard.zero_grad()
    loss = loss_of(model, 0)
    guard.scale_loss(loss).backward()
    assert guard.step(loss).applied and _finite(model)


def test_a_crafted_lr_recovery_count_is_refused_not_turned_into_gradient_ascent():
    # recovered_steps = 2^63-1 loaded, overflowed on the next good step: LR factor -4.6e16.
    model = make_model(6)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                       model.named_parameters())
    state = guard.guard_state_dict()
    # The LR controller's six words end the state: factor, recovery start (doubles as bits),
    # good_steps, recover_after, recover_over, recovered_steps.
    state["guard"][-6:] = [_bits(0.5), _bits(0.5), 0, 0, 10, 9]
    guard.load_guard_state_dict(state)  # a recovery one step from its end: fine
    state["guard"][-1] = 2 ** 63 - 1
    with pytest.raises(RuntimeError, match="recovered_steps 9223372036854775807 is not in"):
        guard.load_guard_state_dict(state)
    for step in range(3):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        report = guard.step(loss)
        assert 0.0 < report.lr_factor <= 1.0, report


def test_only_stats_may_run_between_the_two_phases():
    model = make_model(7)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                       model.named_parameters())
    loss = loss_of(model, 0)
    loss.backward()
    verdict = guard.verdict(loss)
    for misuse in (guard.state_dict, guard.guard_state_dict,
                   lambda: guard.set_data_position(5), guard.commit_pending_checkpoint):
        with pytest.raises(RuntimeError, match="waits for its settle"):
            misuse()
    assert guard.stats().step_count == 1  # stats() may run
    guard.optimizer.step()
    assert guard.settle(verdict, True).applied
    state = guard.guard_state_dict()
    assert state["step"] == 1 and state["totals"]["steps"] == 1, state
    guard.set_data_position(5)


def test_settle_takes_only_its_own_guards_verdict():
    a, b = make_model(8), make_model(8)
    guard_a = stepguard.GuardedOptimizer(torch.optim.SGD(a.parameters(), lr=1e-3))
    guard_b = stepguard.GuardedOptimizer(torch.optim.SGD(b.parameters(), lr=1e-3))
    loss_a, loss_b = loss_of(a, 0), loss_of(b, 0)
    loss_a.backward()
    loss_b.backward()
    verdict_a, verdict_b = guard_a.verdict(loss_a), guard_b.verdict(loss_b)
    assert verdict_a.step == verdict_b.step == 1
    with pytest.raises(RuntimeError, match="a verdict of another guard"):
        guard_b.settle(verdict_a, True)
    assert guard_b.settle(verdict_b, False).skipped
    assert guard_a.settle(verdict_a, False).skipped


def test_a_parameter_listed_twice_is_refused_not_counted_twice():
    model = torch.nn.Linear(4, 2)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        optimizer = torch.optim.SGD([model.weight, model.bias, model.weight], lr=0.1)
    with pytest.raises(RuntimeError, match=r"parameter 2 \(.*\) is parameter 0 .* the same tensor "
                                           r"twice"):
        stepguard.GuardedOptimizer(optimizer)

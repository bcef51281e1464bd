"""torch.optim's contract, kept by the guard: the hook registrars work and their hooks fire
around the guarded step and its state dict; parameters are tracked by identity (a swap of the
tensors in a param group is seen); an exception from the wrapped optimizer keeps its type."""

import pytest
import torch

import stepguard
from conftest import loss_of, make_model


def _backward(guard, model, batch, poison=None):
    guard.zero_grad()
    loss = loss_of(model, batch)
    loss.backward()
    if poison is not None:
        poison.grad.view(-1)[0] = float("nan")
    return loss


def test_step_hooks_fire_around_every_guarded_step_and_inner_hooks_on_applied_ones():
    model = make_model(1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = stepguard.GuardedOptimizer(inner, model.named_parameters())
    events = []
    guard.register_step_pre_hook(lambda opt, args, kwargs: events.append(
        ("pre", opt is guard, opt.stats().step_count)))
    guard.register_step_post_hook(lambda opt, args, kwargs: events.append(
        ("post", opt is guard, opt.stats().step_count)))
    inner.register_step_post_hook(lambda opt, args, kwargs: events.append(("inner", opt is inner,
                                                                           None)))
    loss = _backward(guard, model, 0)
    assert guard.step(loss).applied
    loss = _backward(guard, model, 1, poison=next(model.parameters()))
    assert guard.step(loss).skipped
    assert events == [("pre", True, 0), ("inner", True, None), ("post", True, 1),
                      ("pre", True, 1), ("post", True, 2)]


def test_a_step_pre_hook_may_replace_the_arguments_as_torch_allows():
    model = make_model(2)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    nan_loss = torch.tensor(float("nan"))
    guard.register_step_pre_hook(lambda opt, args, kwargs: (args[:1] + (nan_loss,), kwargs))
    loss = _backward(guard, model, 0)
    report = guard.step(loss)
    assert report.skipped and report.loss_given and report.loss != report.loss  # NaN


def test_state_dict_hooks_run_around_the_guards_state_dict():
    model = make_model(3)
    guard = stepguard.GuardedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                       model.named_parameters())
    guard.step(_backward(guard, model, 0))
    seen = []
    guard.register_state_dict_pre_hook(lambda opt: seen.append("pre"))
    guard.register_state_dict_post_hook(lambda opt, sd: dict(sd, extra=7))
    guard.register_load_state_dict_pre_hook(
        lambda opt, sd: {k: v for k, v in sd.items() if k != "extra"})
    guard.register_load_state_dict_post_hook(lambda opt: seen.append("loaded"))
    state = guard.state_dict()
    assert seen == ["pre"] and state["extra"] == 7 and set(state) == {"optimizer", "stepguard",
                                                                      "extra"}
    guard.load_state_dict(state)  # the pre-hook takes "extra" out again
    assert seen == ["pre", "loaded"]
    assert guard.guard_state_dict() == state["stepguard"]


def test_help_documents_the_state_dict_layout():
    doc = stepguard.GuardedOptimizer.__doc__
    assert '"optimizer"' in doc and '"stepguard"' in doc and "guard_state_dict()" in doc


def test_tensors_swapped_into_a_param_group_are_guarded_and_keep_their_names():
    """accelerate's _switch_parameters replaces a group's tensors with others of the same count:
    the guard must inspect the new ones, or a NaN gradient on them is applied."""
    model = make_model(4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = stepguard.GuardedOptimizer(inner, model.named_parameters(), policy_yaml="""
version: 1
checkpoint: {snapshot_every: 1, snapshot_keep: 2}
rules:
  - {on: nonfinite_grad, action: rollback, skip_batches: 0}
""")
    for batch in range(3):
        assert guard.step(_backward(guard, model, batch)).applied
    assert guard.stats().snapshots_held >= 2  # a confirmed one among them
    swapped = [torch.nn.Parameter(p.detach().clone()) for p in inner.param_groups[0]["params"]]
    inner.param_groups[0]["params"] = swapped
    guard.zero_grad()
    loss = sum((p * p).sum() for p in swapped)
    loss.backward()
    swapped[2].grad.view(-1)[0] = float("nan")
    report = guard.step(loss)
    assert not report.applied and report.nonfinite_count == 1
    # The snapshots held the old tensors: dropped, so the rollback became a skip.
    assert report.skipped and not report.rolled_back
    assert all(torch.isfinite(p).all() for p in swapped)
    assert report.incident["tensors"] == ["2.weight"]


def test_an_exception_of_the_wrapped_optimizer_keeps_its_type_and_the_guard_goes_on():
    model = make_model(5)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = stepguard.GuardedOptimizer(inner, model.named_parameters())
    original = inner.step
    fail = [True]

    def step(*args, **kwargs):
        if fail[0]:
            fail[0] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(*args, **kwargs)

    inner.step = step
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as caught:
        guard.step(_backward(guard, model, 0))
    assert isinstance(caught.value.__cause__, stepguard.StepguardError)
    assert any("recorded step 1 as skipped" in n for n in getattr(caught.value, "__notes__", []))
    stats = guard.stats()
    assert stats.step_count == 1 and stats.totals.steps == 1 and stats.totals.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    report = guard.step(_backward(guard, model, 1))
    assert report.applied and report.step == 2


def test_the_guard_state_names_its_totals_and_reads_the_positional_ones_of_before():
    model = make_model(6)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    guard.step(_backward(guard, model, 0))
    guard.step(_backward(guard, model, 1, poison=next(model.parameters())))
    state = guard.guard_state_dict()
    assert state["totals"] == {"steps": 2, "applied": 1, "skipped": 1, "rolled_back": 0,
                               "aborted": 0, "incidents": 1, "snapshots": 0,
                               "checkpoints_written": 0}
    other = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    old = dict(state, totals=[2, 1, 1, 0, 0, 1, 0, 0])  # a state dict of an earlier release
    other.load_guard_state_dict(old)
    assert other.guard_state_dict() == state
    fewer = dict(state, totals={"steps": 2, "applied": 1, "skipped": 1})  # counts added since
    other.load_guard_state_dict(fewer)
    assert other.stats().totals.incidents == 0 and other.stats().totals.skipped == 1
    with pytest.raises(KeyError, match="'totals' has no count 'aplied'"):
        other.load_guard_state_dict(dict(state, totals={"aplied": 1}))
    with pytest.raises(TypeError, match="'totals'\\['steps'\\]"):
        other.load_guard_state_dict(dict(state, totals={"steps": "2"}))

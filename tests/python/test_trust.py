"""What is read from disk is trusted only as far as it is checked: a checkpoint's opaque optimizer
bytes never run code, and a checkpoint of another optimizer type is refused before anything
changes. The checkpoints are written by the real engine (checksums valid); only what the port
hands it is crafted."""

import os

import pytest
import torch

import stepguard
from stepguard import _port, _safe_pickle
from conftest import loss_of, make_model


def _train_and_checkpoint(directory, optimizer, model, steps=2):
    guard = stepguard.GuardedOptimizer(optimizer, model.named_parameters(),
                                       checkpoint_dir=str(directory), checkpoint_every=1,
                                       run_id="trust")
    for step in range(steps):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        assert guard.step(loss).applied
    guard.synchronize()
    guard.commit_pending_checkpoint()
    return guard


class _Planted:
    """A value whose unpickling would create a file: what a crafted checkpoint carries."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_checkpoint_runs_no_code_on_resume(tmp_path, monkeypatch, capfd):
    marker = tmp_path / "planted"
    model = make_model(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crafted = _port._FORMAT + __import__("pickle").dumps(
        {"optimizer": "torch.optim.sgd.SGD", "state": [(0, {"x": ("value", _Planted(
            str(marker)))})]})
    # The engine writes the checkpoint (valid checksums); the port hands it the crafted bytes.
    monkeypatch.setattr(_port.TorchOptimPort, "state_bytes", lambda self: crafted)
    _train_and_checkpoint(tmp_path / "ckpt", optimizer, model)
    monkeypatch.undo()
    assert not marker.exists()

    fresh = make_model(2)
    before = [p.detach().clone() for p in fresh.parameters()]
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9),
                                       fresh.named_parameters(), run_id="trust",
                                       checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1)
    # Each crafted checkpoint is refused (named on stderr) and resume falls back to none.
    assert guard.resume(str(tmp_path / "ckpt")) == 0
    err = capfd.readouterr().err
    assert "names 'io.open', which an optimizer state never holds" in err
    assert not marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))


def test_the_restricted_reader_admits_plain_values_only():
    plain = {"a": [1, 2.5, None, True, "x", (3, 4)], "b": {1, 2}, "c": 1 + 2j,
             "d": torch.device("cpu")}
    assert _safe_pickle.loads(_safe_pickle.dumps(plain)) == plain
    with pytest.raises(_safe_pickle.UnsafeStateError, match="'posix.system'"):
        _safe_pickle.loads(__import__("pickle").dumps(os.system))
    with pytest.raises(ValueError, match="do not read back"):
        _safe_pickle.loads(b"\x80\x04\x95garbage")
    # Saving a state that could not be read back is refused when it is saved.
    with pytest.raises(_safe_pickle.UnsafeStateError, match="cannot save this optimizer state"):
        _safe_pickle.dumps({"f": _Planted("/nonexistent")})


def test_resume_into_another_optimizer_type_is_refused_and_changes_nothing(tmp_path, capfd):
    model = make_model(3)
    _train_and_checkpoint(tmp_path / "ckpt",
                          torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    other = make_model(4)
    adam = torch.optim.Adam(other.parameters(), lr=1e-3)
    guard = stepguard.GuardedOptimizer(adam, other.named_parameters(), run_id="trust",
                                       checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1)
    before = [p.detach().clone() for p in other.parameters()]
    # Every checkpoint there is refused, named on stderr; resume() finds none (nothing changes).
    assert guard.resume(str(tmp_path / "ckpt")) == 0
    assert ("written by torch.optim.sgd.SGD; this optimizer is torch.optim.adam.Adam"
            in capfd.readouterr().err)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    assert len(adam.state) == 0 and guard.step_count == 0
    # Training goes on with the optimizer as it was.
    guard.zero_grad()
    loss = loss_of(other, 0)
    loss.backward()
    assert guard.step(loss).applied and "exp_avg" in adam.state[next(other.parameters())]


def test_a_replay_closure_that_calls_step_is_refused():
    model = make_model(5)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    inner = []

    def replay(mode):
        try:
            guard.step()
        except RuntimeError as e:
            inner.append(str(e))
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    guard.set_replay(replay)
    guard.zero_grad()
    loss = loss_of(model, 0)
    loss.backward()
    model[0].weight.grad[0, 0] = float("nan")
    report = guard.step(loss)
    assert report.skipped and report.step == 1 and guard.step_count == 1
    assert inner and "not re-entrant" in inner[0]


@pytest.mark.parametrize("name, error, text", [
    (b"\xff", TypeError, "parameter name must be a str, got bytes"),
    ("bad\udcff", ValueError, "is not valid UTF-8")])
def test_names_that_reports_cannot_carry_are_refused_at_construction(name, error, text):
    model = make_model(6)
    named = [(name if i == 0 else n, p) for i, (n, p) in enumerate(model.named_parameters())]
    with pytest.raises(error, match=text):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    with pytest.raises(error, match=text.replace("parameter", "probe")):
        guard.probe(name, torch.ones(1))


def test_named_parameters_of_another_model_are_refused():
    model, other = make_model(7), make_model(7)
    with pytest.raises(ValueError, match="none of the optimizer's 4 parameters is in "
                                         "named_parameters"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   other.named_parameters())


def _stepped_guard(seed, steps):
    model = make_model(seed)
    guard = stepguard.GuardedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                       model.named_parameters())
    for step in range(steps):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        guard.step(loss)
    return model, guard


def test_load_state_dict_loads_both_parts_or_neither():
    _, saved_from = _stepped_guard(8, 5)
    state = saved_from.state_dict()
    state["optimizer"]["param_groups"][0]["params"] = [0]  # the optimizer part cannot load
    model, guard = _stepped_guard(9, 1)
    with pytest.raises(ValueError):
        guard.load_state_dict(state)
    assert guard.step_count == 1 and guard.totals["applied"] == 1


@pytest.mark.parametrize("key, value, error, text", [
    ("step", 2 ** 63 - 1, stepguard.StepguardError, "'step' is 9223372036854775807, not in"),
    ("totals", [-1] * 8, stepguard.StepguardError, "'totals' is -1, not in"),
    ("step", "5", TypeError, "the guard state's 'step' must be an int, got str"),
    ("step", None, TypeError, "the guard state's 'step' must be an int, got NoneType"),
    (None, None, KeyError, "lacks the key 'data_position'")])
def test_a_guard_state_out_of_range_or_of_the_wrong_type_names_the_key(key, value, error, text):
    _, source = _stepped_guard(10, 2)
    state = source.state_dict()
    if key is None:
        del state["stepguard"]["data_position"]
    else:
        state["stepguard"][key] = value
    _, guard = _stepped_guard(11, 1)
    with pytest.raises(error, match=text):
        guard.load_state_dict(state)
    assert guard.step_count == 1

"""What is read from disk is trusted only as far as it is checked: a checkpoint's opaque optimizer
bytes never run code, and a checkpoint of another optimizer type is refused before anything
changes. The checkpoints are written by the real engine (checksums valid); only what the port
hands it is crafted."""

import os

import pytest
import torch

import stepguard
from stepguard import _port, _safe_pickle
from conftest import loss_of, make_model, stepped_guard


# Snapshots every step; a NaN loss rolls back to the newest confirmed one.
_ROLLBACK_ON_NAN_LOSS = """
version: 1
checkpoint: {snapshot_every: 1, snapshot_keep: 2}
rules:
  - {on: nonfinite_loss, action: rollback, skip_batches: 1}
"""


def _train_and_checkpoint(directory, optimizer, model, steps=2):
    guard = stepguard.GuardedOptimizer(optimizer, model.named_parameters(),
                                       checkpoint_dir=str(directory), checkpoint_every=1,
                                       run_id="trust")
    for step in range(steps):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        assert guard.step(loss).applied
        # Each step's checkpoint written before the next step: a write still in flight makes the
        # next one skip its checkpoint, which on a slow disk left none to test.
        guard.wait_for_background_work()
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
    # open pickles as io.open on Python 3.11 and as _io.open on 3.13: the name pickle wrote.
    assert ("names '%s.open', which an optimizer state never holds" % open.__module__) in err
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
    assert len(adam.state) == 0 and guard.stats().step_count == 0
    # Starting this run there would prune the checkpoints it refused: its first step stops, with
    # nothing written and nothing deleted.
    kept = sorted(os.listdir(tmp_path / "ckpt"))
    guard.zero_grad()
    loss = loss_of(other, 0)
    loss.backward()
    with pytest.raises(RuntimeError, match="holds checkpoints of this run \\('trust'\\) that it "
                                           "did not resume from"):
        guard.step(loss)
    assert sorted(os.listdir(tmp_path / "ckpt")) == kept
    # In another directory training goes on with the optimizer as it was.
    guard = stepguard.GuardedOptimizer(adam, other.named_parameters(), run_id="trust",
                                       checkpoint_dir=str(tmp_path / "new"), checkpoint_every=1)
    assert guard.step(loss).applied and "exp_avg" in adam.state[next(other.parameters())]


def test_resume_into_the_same_optimizer_with_another_state_layout_is_refused(tmp_path, capfd):
    """Adam(amsgrad=False) saved, Adam(amsgrad=True) resuming: the state lacks max_exp_avg_sq, so
    the first step would raise KeyError. Refused before anything changes; training goes on."""
    model = make_model(3)
    _train_and_checkpoint(tmp_path / "ckpt", torch.optim.Adam(model.parameters(), lr=1e-3), model)
    other = make_model(4)
    adam = torch.optim.Adam(other.parameters(), lr=1e-3, amsgrad=True)
    resumed = stepguard.GuardedOptimizer(adam, other.named_parameters())
    before = [p.detach().clone() for p in other.parameters()]
    assert resumed.resume(str(tmp_path / "ckpt")) == 0
    assert "written with amsgrad=False in param group 0; this optimizer has amsgrad=True" in \
        capfd.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    resumed.zero_grad()
    loss = loss_of(other, 0)
    loss.backward()
    assert resumed.step(loss).applied and "max_exp_avg_sq" in adam.state[next(other.parameters())]


def test_resume_puts_back_the_param_groups_hyper_parameters(tmp_path, capfd):
    """An lr lowered during training (0.1 -> 0.025, as a schedule does) and a weight decay set
    per group come back with the checkpoint, as optimizer.load_state_dict() brings them; a
    stateless SGD's too (its checkpoint holds no state tensors at all)."""
    for momentum in (0.9, 0.0):
        model = make_model(5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        optimizer.param_groups[0]["lr"] = 0.025
        optimizer.param_groups[0]["weight_decay"] = 0.01
        _train_and_checkpoint(tmp_path / str(momentum), optimizer, model)
        other = make_model(6)
        fresh = torch.optim.SGD(other.parameters(), lr=0.1, momentum=momentum)
        resumed = stepguard.GuardedOptimizer(fresh, other.named_parameters(), run_id="trust")
        assert resumed.resume(str(tmp_path / str(momentum))) == 2
        assert fresh.param_groups[0]["lr"] == 0.025
        assert fresh.param_groups[0]["weight_decay"] == 0.01
        assert fresh.param_groups[0]["params"] == list(other.parameters())
        assert fresh.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


def test_a_checkpoint_of_another_group_count_or_a_bad_lr_is_refused(tmp_path, capfd):
    model = make_model(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_and_checkpoint(tmp_path / "ckpt", optimizer, model)
    port = _port.TorchOptimPort(optimizer, model.named_parameters())
    data = port.state_bytes()
    tensors = port.state_tensors()
    record = _safe_pickle.loads(data[2:])
    for groups, text in ((record["groups"] * 2, "has 2 param groups; this optimizer has 1"),
                         ([dict(record["groups"][0], lr=-3.0)],
                          "the saved lr of param group 0 is -3.0, not a finite number >= 0"),
                         ([dict(record["groups"][0], lr=float("nan"))], "is nan"),
                         ([{"params": [0]}], "settings of param group 0 are malformed")):
        crafted = b"P2" + _safe_pickle.dumps(dict(record, groups=groups))
        with pytest.raises(ValueError, match=text):
            port.check_state_bytes(crafted, tensors)
    # A two-group optimizer resuming a one-group checkpoint: refused, nothing changes.
    other = make_model(8)
    params = list(other.parameters())
    two = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1,
                          momentum=0.9)
    resumed = stepguard.GuardedOptimizer(two, other.named_parameters(), run_id="trust")
    assert resumed.resume(str(tmp_path / "ckpt")) == 0
    assert "has 1 param groups; this optimizer has 2" in capfd.readouterr().err
    assert [g["lr"] for g in two.param_groups] == [0.1, 0.5]


def test_a_rollback_keeps_the_live_lr_of_the_loops_schedule():
    """A snapshot's groups are not put back by a rollback: the schedule has moved on since."""
    model = make_model(9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = stepguard.GuardedOptimizer(optimizer, model.named_parameters(), policy_yaml=_ROLLBACK_ON_NAN_LOSS)
    _run_steps(guard, model, 3)
    optimizer.param_groups[0]["lr"] = 0.05
    guard.zero_grad()
    loss = loss_of(model, 5)
    loss.backward()
    assert guard.step(loss * float("nan")).rolled_back
    assert optimizer.param_groups[0]["lr"] == 0.05


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
    assert report.skipped and report.step == 1 and guard.stats().step_count == 1
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



def test_load_state_dict_loads_both_parts_or_neither():
    _, saved_from = stepped_guard(8, 5)
    state = saved_from.state_dict()
    state["optimizer"]["param_groups"][0]["params"] = [0]  # the optimizer part cannot load
    model, guard = stepped_guard(9, 1)
    with pytest.raises(ValueError):
        guard.load_state_dict(state)
    assert guard.stats().step_count == 1 and guard.stats().totals.applied == 1


@pytest.mark.parametrize("key, value, error, text", [
    ("step", 2 ** 63 - 1, stepguard.StepguardError, "'step' is 9223372036854775807, not in"),
    ("totals", [-1] * 8, stepguard.StepguardError, "'totals' is -1, not in"),
    ("step", "5", TypeError, "the guard state's 'step' must be an int, got str"),
    ("step", None, TypeError, "the guard state's 'step' must be an int, got NoneType"),
    (None, None, KeyError, "lacks the key 'data_position'")])
def test_a_guard_state_out_of_range_or_of_the_wrong_type_names_the_key(key, value, error, text):
    _, source = stepped_guard(10, 2)
    state = source.state_dict()
    if key is None:
        del state["stepguard"]["data_position"]
    else:
        state["stepguard"][key] = value
    _, guard = stepped_guard(11, 1)
    with pytest.raises(error, match=text):
        guard.load_state_dict(state)
    assert guard.stats().step_count == 1


def _traced_guard(model, trace):
    return stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      model.named_parameters(), trace_path=str(trace))


def _run_steps(guard, model, steps):
    for step in range(steps):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        guard.step(loss)


def test_a_trace_belongs_to_one_live_guard_and_an_earlier_one_is_kept(tmp_path, capfd):
    import json
    trace = tmp_path / "trace.jsonl"
    model = make_model(12)
    first = _traced_guard(model, trace)
    with pytest.raises(stepguard.StepguardError, match="another live guard writes it"):
        _traced_guard(make_model(13), trace)
    _run_steps(first, model, 4)
    del first
    import gc
    gc.collect()
    second = _traced_guard(model, trace)
    assert "is kept as '%s.1'" % trace in capfd.readouterr().err
    _run_steps(second, model, 2)
    kept = [json.loads(line) for line in (tmp_path / "trace.jsonl.1").read_text().splitlines()]
    now = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3, 4]
    assert [r["step"] for r in now] == [1, 2]


def test_a_replay_leaves_the_tracked_buffers_as_the_steps_forward_left_them():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 4))
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    guard.track_buffers(model.named_buffers())
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    replays = []

    def replay(mode):
        replays.append(mode)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    guard.set_replay(replay)
    guard.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    after_forward = {n: b.clone() for n, b in model.named_buffers()}
    model[0].weight.grad[0, 0] = float("nan")
    assert guard.step(loss).skipped and replays
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, after_forward[name]), name


def test_two_runs_started_in_one_checkpoint_directory_never_touch_each_others_files(tmp_path):
    directory = str(tmp_path / "ckpt")
    model_a, model_b = make_model(20), make_model(21)
    a = stepguard.GuardedOptimizer(torch.optim.SGD(model_a.parameters(), lr=0.1),
                                   model_a.named_parameters(), checkpoint_dir=directory,
                                   checkpoint_every=1, run_id="run-a")
    b = stepguard.GuardedOptimizer(torch.optim.SGD(model_b.parameters(), lr=0.1),
                                   model_b.named_parameters(), checkpoint_dir=directory,
                                   checkpoint_every=1, run_id="run-b")
    _run_steps(a, model_a, 1)  # run A takes the directory at its first step
    with pytest.raises(stepguard.StepguardError, match="is in use by another live run \\(process "
                                                       "%d holds" % os.getpid()):
        _run_steps(b, model_b, 1)
    assert b.stats().step_count == 0
    for step in range(3):
        _run_steps(a, model_a, 1)
        a.wait_for_background_work()  # each checkpoint written before the next is due (none skipped)
    a.commit_pending_checkpoint()
    del a  # its background work (pruning) finishes with it
    import gc
    gc.collect()

    def committed():
        return sorted(n for n in os.listdir(directory) if n.startswith("step-"))

    written = committed()
    assert written[-1] == "step-000000004"
    fresh = make_model(22)
    again = stepguard.GuardedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1),
                                       fresh.named_parameters(), checkpoint_dir=directory,
                                       checkpoint_every=1, run_id="run-a")
    assert again.resume(directory) == 4 and committed() == written


def test_the_guard_is_saved_as_its_state_dict_never_pickled_whole(tmp_path):
    import io
    model = make_model(23)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="cannot be pickled or torch.save\\(\\)d whole"):
        torch.save(guard, io.BytesIO())
    buffer = io.BytesIO()
    torch.save(guard.state_dict(), buffer)  # the way that works


def test_a_rollback_keeps_what_is_not_a_parameters_state():
    model = make_model(24)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.state["schedule"] = {"phase": 2}  # a subclass's own entry
    guard = stepguard.GuardedOptimizer(optimizer, model.named_parameters(), policy_yaml=_ROLLBACK_ON_NAN_LOSS)
    _run_steps(guard, model, 3)
    guard.zero_grad()
    loss = loss_of(model, 5)
    loss.backward()
    assert guard.step(loss * float("nan")).rolled_back
    assert optimizer.state["schedule"] == {"phase": 2}


def test_check_inputs_refuses_a_mask_of_another_shape_and_sees_complex_nans():
    model = make_model(25)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = torch.zeros(4, 16, dtype=torch.long)
    with pytest.raises(stepguard.StepguardError, match=r"the mask is \[3, 16\] but input 0 is "
                                                       r"\[4, 16\]"):
        guard.check_inputs([tokens], torch.ones(3, 16, dtype=torch.bool))
    assert guard.check_inputs([tokens], torch.ones(4, 16, dtype=torch.bool))
    signal = torch.ones(4, 8, dtype=torch.complex64)
    signal[1, 2] = complex(float("nan"), 0.0)
    verdict = guard.check_inputs([signal])
    assert not verdict and "1 NaN value" in " ".join(verdict.problems)


ONE_RULE = """version: 1
rules:
  - {name: skip-nan, on: nonfinite, action: skip_batch}
"""


@pytest.mark.parametrize("word, value, text", [
    (12, 10 ** 15, "a rule's last firing at step 1000000000000000, after its own step 2"),
    (2, 0x7FF8000000000000, "loss average that is not a finite number"),
    (0, -3, "consecutive_bad_steps -3, not in")])
def test_decision_state_words_out_of_range_are_refused(word, value, text):
    model = make_model(26)
    source = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        policy_yaml=ONE_RULE)
    _run_steps(source, model, 2)
    state = source.state_dict()
    state["stepguard"]["guard"][word] = value
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       policy_yaml=ONE_RULE)
    with pytest.raises(stepguard.StepguardError, match=text.replace("(", "\\(")):
        guard.load_state_dict(state)
    assert guard.stats().step_count == 0


def test_a_port_written_before_the_settings_argument_still_rolls_back():
    """A port subclass whose load_state_bytes takes (data, saved), as before the third argument
    came, is called with two; the rollback restores as before."""
    from stepguard._port import TorchOptimPort

    calls = []

    class OldPort(TorchOptimPort):
        def load_state_bytes(self, data, saved):
            calls.append(len(saved))
            return super().load_state_bytes(data, saved)

    model = make_model(9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = stepguard.GuardedOptimizer(optimizer, model.named_parameters(),
                                       port=OldPort(optimizer), policy_yaml=_ROLLBACK_ON_NAN_LOSS)
    _run_steps(guard, model, 3)
    guard.zero_grad()
    loss = loss_of(model, 5)
    loss.backward()
    assert guard.step(loss * float("nan")).rolled_back
    assert calls and calls[0] > 0

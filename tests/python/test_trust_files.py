"""What a run may touch and what it checks before anything changes (the fourth round): reports of
another run are kept, a planted link is never written through, a trace that cannot be written
never makes a step's outcome unknown, loaded guard state and option values are checked whole."""

import os
import struct
import subprocess
import sys

import pytest
import torch

import stepguard
from conftest import loss_of, make_model


def _nan_step(guard, model, step):
    guard.zero_grad()
    loss = loss_of(model, step)
    loss.backward()
    next(model.parameters()).grad[0] = float("nan")
    return guard.step(loss)


def test_a_second_run_in_the_same_incident_dir_keeps_the_first_runs_reports(tmp_path):
    reports = []
    for run in range(2):
        model = make_model(1)
        guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           model.named_parameters(),
                                           incident_dir=str(tmp_path))
        report = _nan_step(guard, model, 0)
        reports.append(report.incident["report"])
    assert reports[0] != reports[1], reports
    assert reports[1].endswith("incident-step-000000001.1.json"), reports
    for path in reports:
        assert os.path.exists(path) and os.path.exists(path[:-len(".json")] + ".md")


def test_a_link_planted_at_the_batch_files_name_is_not_written_through(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("precious")
    incidents = tmp_path / "incidents"
    incidents.mkdir()
    os.symlink(outside, incidents / "incident-step-000000001.batch.pt")
    model = make_model(1)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), incident_dir=str(incidents))
    guard.check_inputs([torch.randn(2, 8)])
    report = _nan_step(guard, model, 0)
    assert outside.read_text() == "precious"
    batch = report.incident["report"][:-len(".json")] + ".batch.pt"
    assert os.path.isfile(batch) and not os.path.islink(batch), batch
    assert os.path.getsize(batch) > 0


def test_a_trace_that_cannot_be_written_never_hides_whether_the_step_was_applied(tmp_path):
    # After the first step the process may not grow any file (RLIMIT_FSIZE): every later trace
    # line fails to be written, as on a full disk.
    code = (
        "import resource, signal, sys, torch, stepguard\n"
        "sys.path.insert(0, %r)\n"
        "from conftest import loss_of, make_model\n"
        "model = make_model(1)\n"
        "guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "    trace_path=%r, trace_every_step=True)\n"
        "for step in range(3):\n"
        "    guard.zero_grad(); loss = loss_of(model, step); loss.backward()\n"
        "    print(guard.step(loss).outcome, flush=True)\n"
        "    if step == 0:\n"
        "        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "        resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))\n"
        "print(guard.stats().totals.applied)\n"
        % (os.path.dirname(os.path.abspath(__file__)), str(tmp_path / "trace.jsonl")))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["applied", "applied", "applied", "3"], done.stdout
    assert "File too large; the step stands (1 trace line(s) lost so far)" in done.stderr, \
        done.stderr[-3000:]
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 1


def test_guard_state_whose_lr_recovery_would_go_below_zero_is_refused():
    model = make_model(1)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    state = guard.state_dict()
    words = list(state["stepguard"]["guard"])
    # The LR controller's six words end the state: factor, recovery_start, ... (doubles as bits).
    bits = lambda x: struct.unpack("<q", struct.pack("<d", x))[0]  # noqa: E731
    words[-6], words[-5] = bits(0.5), bits(-3.0)
    state["stepguard"]["guard"] = words
    before = guard.state_dict()["stepguard"]
    with pytest.raises(RuntimeError, match=r"recovery start -3.000000 is not in \(0, 1\]"):
        guard.load_state_dict(state)
    assert guard.state_dict()["stepguard"] == before


def test_a_data_position_no_checkpoint_could_hold_is_refused_at_the_setter():
    model = make_model(1)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    guard.set_data_position(2 ** 52)
    with pytest.raises(RuntimeError, match=r"data position must be in \[0, 2\^52\], got "
                                           "9007199254740992"):
        guard.set_data_position(2 ** 53)
    assert guard.stats().data_position == 2 ** 52


@pytest.mark.parametrize("option", ["trace_path", "checkpoint_dir", "incident_dir", "policy"])
def test_a_nul_in_a_path_is_refused_naming_the_option(tmp_path, option):
    model = make_model(1)
    with pytest.raises(RuntimeError, match="stepguard: %s holds a NUL character" % option):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   **{option: str(tmp_path / "a") + "\0b"})
    assert os.listdir(tmp_path) == []


def test_an_option_of_the_wrong_type_is_a_type_error_naming_it():
    model = make_model(1)
    with pytest.raises(TypeError, match="stepguard: option store must be a torch.distributed Store "
                                        r"\(e.g. dist.TCPStore, dist.FileStore\), got object"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), store=object())
    with pytest.raises(TypeError,
                       match="stepguard: option checkpoint_every must be an int, got str"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   checkpoint_every="often")


def test_a_rollback_after_add_param_group_skips_instead_of_aborting(capfd):
    """Progressive unfreezing: a group added after the snapshots were taken. A loss spike then
    cannot restore the old list into the new one: the step is skipped, training goes on."""
    model = make_model(2)
    first, *rest = list(model.parameters())
    policy = ("version: 1\ncheckpoint: {snapshot_every: 1, snapshot_keep: 2}\n"
              "detectors:\n  loss_spike: {z: 6, warmup: 3, early_factor: 10}\n"
              "rules:\n  - {name: spike, on: loss_spike, action: rollback}\n")
    guard = stepguard.GuardedOptimizer(torch.optim.SGD([first], lr=0.01),
                                       model.named_parameters(), policy_yaml=policy)
    outcomes = []
    for step in range(8):
        if step == 5:
            guard.add_param_group({"params": rest})
        guard.zero_grad()
        loss = loss_of(model, step) * (1000.0 if step == 6 else 1.0)
        loss.backward()
        report = guard.step(loss)
        outcomes.append(report.outcome)
    assert outcomes == ["applied"] * 6 + ["skipped", "applied"], outcomes
    assert not guard.stats().aborted
    assert "the optimizer's parameters changed (4 now, 1 before" in capfd.readouterr().err

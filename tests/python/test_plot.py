"""stepguard plot: pictures of a run drawn from a real demo trace (the C++ demo with injected
faults), read back through what plot_trace() says it drew and checked against the run's own
summary; bad input named by file and line; `stepguard plot` end to end; the pictures linked
from incident reports (demo and GuardedOptimizer)."""

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys

import pytest
import torch

import stepguard
from stepguard import plot
from conftest import loss_of, make_model

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(
    not HAVE_MATPLOTLIB, reason="matplotlib is not installed (it is pinned in requirements.txt): "
                                "no pictures can be drawn")

BUILD = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(stepguard.__file__))))
STEPGUARD = os.path.join(BUILD, "bin", "stepguard")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) from the PNG's IHDR chunk; fails unless the file is a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_MAGIC, "%s is not a PNG" % path
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def assert_picture(path):
    width, height = png_size(path)
    assert 600 <= width <= 3000 and 300 <= height <= 2000, (width, height)
    assert os.path.getsize(path) > 10_000  # lines, marks and text, not an empty canvas


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A short demo with a NaN gradient, a loss spike (rolled back) and a NaN loss."""
    if not os.access(STEPGUARD, os.X_OK):
        pytest.skip("no %s (the C++ build's stepguard command)" % STEPGUARD)
    d = tmp_path_factory.mktemp("demo")
    run = {"trace": str(d / "trace.jsonl"), "summary": str(d / "summary.json"),
           "incidents": str(d / "incidents"), "dir": d}
    r = subprocess.run(
        [STEPGUARD, "demo", "--steps", "100", "--batch-size", "4", "--context", "32",
         "--threads", "1", "--inject", "nan_grad@30", "--inject", "loss_spike@70",
         "--inject", "nan_loss@85", "--trace", run["trace"], "--summary-json", run["summary"],
         "--incident-dir", run["incidents"]],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    run["stdout"] = r.stdout
    with open(run["summary"]) as f:
        run["s"] = json.load(f)
    return run


def rollback_target(incident):
    match = re.search(r"rolled back to step (\d+)", incident["reason"])
    assert match, incident["reason"]
    return int(match.group(1))


@needs_matplotlib
def test_the_whole_run_is_drawn_with_every_incident_and_rollback(demo_run):
    out = str(demo_run["dir"] / "run.png")
    drawn = plot.plot_trace(demo_run["trace"], out)
    assert_picture(out)
    s = demo_run["s"]
    assert drawn["steps"] == list(range(1, s["steps"] + 1))
    # The marks are the run's incidents as the engine named them in its summary.
    assert [(i["step"], i["signal"], i["action"]) for i in drawn["incidents"]] == \
        [(i["step"], i["signal"], i["action"]) for i in s["incidents"]]
    assert [i["step"] for i in drawn["incidents"]] == [30, 70, 85]
    spike = [i for i in s["incidents"] if i["step"] == 70][0]
    assert spike["action"] == "rollback" and s["rollbacks"] == 1
    assert drawn["rollbacks"] == [{"from": 70, "to": rollback_target(spike)}]
    assert rollback_target(spike) < 70
    assert drawn["loss_scale"] is False  # an fp32 demo: no loss scale to draw


@needs_matplotlib
def test_the_loss_scale_is_drawn_for_a_run_that_scales_its_loss_only(tmp_path):
    """An fp32 run's trace holds a loss scale of 1 on every step: its panel shows the LR factor
    alone (it drew a flat, empty-looking loss-scale line before); a scaled run's is drawn."""
    row = {"step": 1, "loss": 2.5, "grad_norm": 0.5, "loss_scale": 1.0, "lr_factor": 1.0,
           "outcome": "applied", "actions": ["apply"], "action": "apply"}
    for name, scales, drawn_scale in (("fp32", [1.0, 1.0, 1.0, 1.0], False),
                                      ("fp16", [65536.0, 65536.0, 32768.0, 32768.0], True)):
        trace = tmp_path / ("%s.jsonl" % name)
        trace.write_text("".join(json.dumps(dict(row, step=i + 1, loss_scale=scale)) + "\n"
                                 for i, scale in enumerate(scales)))
        out = str(tmp_path / ("%s.png" % name))
        drawn = plot.plot_trace(str(trace), out)
        assert drawn["loss_scale"] is drawn_scale and drawn["steps"] == [1, 2, 3, 4]
        assert_picture(out)


@needs_matplotlib
def test_around_an_incident_draws_its_steps_and_back_to_the_step_restored(demo_run):
    out = str(demo_run["dir"] / "around.png")
    drawn = plot.plot_trace(demo_run["trace"], out, around=70, window=5)
    assert_picture(out)
    target = rollback_target([i for i in demo_run["s"]["incidents"] if i["step"] == 70][0])
    assert drawn["steps"] == list(range(target, 76))
    assert [(i["step"], i["signal"]) for i in drawn["incidents"]] == [(70, "loss_spike")]
    assert drawn["rollbacks"] == [{"from": 70, "to": target}]
    drawn = plot.plot_trace(demo_run["trace"], out, around=30, window=3)
    assert drawn["steps"] == [27, 28, 29, 30, 31, 32, 33] and drawn["rollbacks"] == []
    with pytest.raises(plot.TraceError, match=r"no steps within 3 of step 500 \(the trace holds "
                                              r"steps 1 to 100\)"):
        plot.plot_trace(demo_run["trace"], out, around=500, window=3)


@needs_matplotlib
def test_the_demo_links_a_picture_from_each_incident_report(demo_run):
    s = demo_run["s"]
    assert "pictures" in demo_run["stdout"]
    for inc in s["incidents"]:
        report = inc["report"]
        picture = report[:-len(".json")] + ".png"
        assert inc["picture"] == picture
        assert_picture(picture)
        with open(report) as f:
            assert json.load(f)["picture"] == picture
        with open(report[:-len(".json")] + ".md") as f:
            markdown = f.read()
        assert "![steps around the incident](%s)" % os.path.basename(picture) in markdown
        assert markdown.startswith("# Incident at step %d" % inc["step"])  # still the report


@needs_matplotlib
def test_stepguard_plot_command_and_module_end_to_end(demo_run):
    out = str(demo_run["dir"] / "cli.png")
    r = subprocess.run([STEPGUARD, "plot", demo_run["trace"], "-o", out, "--around", "85"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert_picture(out)
    assert out in r.stdout and "steps 35 to 100" in r.stdout
    out = str(demo_run["dir"] / "module.png")
    r = subprocess.run([sys.executable, "-m", "stepguard.plot", demo_run["trace"], "-o", out],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert_picture(out)
    r = subprocess.run([STEPGUARD, "--help"], capture_output=True, text=True, timeout=30)
    assert "  plot TRACE.jsonl -o OUT.png" in r.stdout


def test_a_bad_trace_is_named_by_file_and_line(tmp_path):
    good = {"step": 1, "loss": 2.5, "grad_norm": 0.5, "loss_scale": 1.0, "lr_factor": 1.0,
            "outcome": "applied", "actions": ["apply"]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n\n" + '{"step": 3, "loss": 2.4' + "\n")
    with pytest.raises(plot.TraceError, match=r"bad\.jsonl:3: not JSON"):
        plot.plot_trace(str(bad), str(tmp_path / "x.png"))
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, step=2, loss="high")) + "\n")
    with pytest.raises(plot.TraceError, match=r"wrong\.jsonl:2: 'loss' is \"high\", not a number"):
        plot.plot_trace(str(wrong), str(tmp_path / "x.png"))
    noaction = tmp_path / "noaction.jsonl"
    noaction.write_text(json.dumps(dict(good, signals=["nonfinite_grad"],
                                        actions=["skip_batch"])) + "\n")
    with pytest.raises(plot.TraceError,
                       match=r"noaction\.jsonl:1: 'action' is missing, not the name of the step"):
        plot.read_trace(str(noaction))
    nostep = tmp_path / "nostep.jsonl"
    nostep.write_text('{"loss": 1.0}\n')
    with pytest.raises(plot.TraceError, match=r"nostep\.jsonl:1: 'step' is missing"):
        plot.read_trace(str(nostep))
    assert not os.path.exists(tmp_path / "x.png")

    # The command: exit 2, one line naming the file and line, no traceback.
    for args, message in (([str(bad), "-o", str(tmp_path / "x.png")], "bad.jsonl:3: not JSON"),
                          ([str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "x.png")],
                           "none.jsonl: cannot read: No such file or directory")):
        r = subprocess.run([sys.executable, plot.__file__] + args, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2, r.stderr
        assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("stepguard plot: ")


@needs_matplotlib
def test_guarded_optimizer_draws_a_picture_beside_its_incident_report(tmp_path):
    model = make_model(3)
    trace, incidents = tmp_path / "trace.jsonl", tmp_path / "incidents"
    # A link planted at the picture's name: replaced, never written through.
    incidents.mkdir()
    outside = tmp_path / "outside.png"
    outside.write_bytes(b"not the guard's")
    os.symlink(outside, incidents / "incident-step-000000004.png")
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), trace_path=str(trace),
                                       incident_dir=str(incidents))
    for step in range(6):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        if step == 3:
            model[0].weight.grad[0, 0] = float("nan")
        report = guard.step(loss)
        if step == 3:
            incident = report.incident
    report_path = incident["report"]
    picture = report_path[:-len(".json")] + ".png"
    assert picture == str(incidents / "incident-step-000000004.png")
    assert outside.read_bytes() == b"not the guard's" and not os.path.islink(picture)
    assert_picture(picture)
    with open(report_path) as f:
        assert json.load(f)["picture"] == picture
    with open(report_path[:-len(".json")] + ".md") as f:
        assert "![steps around the incident](%s)" % os.path.basename(picture) in f.read()
    # Drawn right after its step: the steps up to the incident, which is marked.
    drawn = plot.plot_trace(str(trace), str(tmp_path / "again.png"), around=4, window=10)
    assert [(i["step"], i["signal"], i["action"]) for i in drawn["incidents"]] == \
        [(4, "nonfinite_grad", incident["action"])]
    assert drawn["loss_scale"] is False


def test_without_matplotlib_the_guard_says_once_that_pictures_are_off(tmp_path, monkeypatch,
                                                                     capsys):
    """A pip install without the `plots` extra: the guard with a trace and an incident
    directory says so on stderr (once, at construction) instead of leaving the pictures
    silently out; the incident reports are written as always."""
    from stepguard import _pictures

    real = importlib.util.find_spec
    monkeypatch.setattr(_pictures.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    model = make_model(3)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(),
                                       trace_path=str(tmp_path / "t.jsonl"),
                                       incident_dir=str(tmp_path / "incidents"))
    err = capsys.readouterr().err
    assert err.count("incident pictures need matplotlib") == 1, err
    assert "pip install 'stepguard[plots]'" in err, err
    guard.zero_grad()
    loss = loss_of(model, 1)
    loss.backward()
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    report = guard.step(loss.detach())
    assert report.incident is not None and os.path.exists(report.incident["report"])
    assert not [f for f in os.listdir(tmp_path / "incidents") if f.endswith(".png")]

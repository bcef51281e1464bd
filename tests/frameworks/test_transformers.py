"""The real HF Transformers Trainer (with accelerate) and stepguard's StepguardCallback: a tiny
GPT-2 built from a config (no download) trained on CPU by 2 processes under torchrun, DDP over
Gloo on loopback, gradient accumulation 2, clipping at max_grad_norm, a linear LR schedule.
hf_worker.py (each rank) injects a NaN loss on rank 1 at one step, a NaN in one gradient element
of rank 1 at another, and a loss spike on rank 0 at a third; each rank writes what it saw and the
test checks every rank."""

import json
import os
import signal
import subprocess
import sys
import time

import torch

from conftest import POLICY, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
TIMEOUT = 240  # seconds for the whole torchrun job (it takes ~10 s on 2 cores)


def _kill(proc, out):
    """torchrun's agent, then its workers (each in a session of its own under torch 2.x)."""
    try:
        proc.send_signal(signal.SIGTERM)  # the agent stops its workers
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    groups = [proc.pid]
    for r in range(WORLD):
        try:
            with open(os.path.join(out, "pid%d" % r)) as f:
                groups.append(int(f.read()))
        except (OSError, ValueError):  # not started, or still writing it
            pass
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _run_ranks(out, *mode):
    import stepguard
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(stepguard.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_HOME=os.path.join(out, "hf_home"),
               TOKENIZERS_PARALLELISM="false", DISABLE_MLFLOW_INTEGRATION="TRUE",
               WANDB_DISABLED="true",
               PYTHONPATH=os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH")]
                                          if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(WORLD), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "--max_restarts", "0",
           os.path.join(HERE, "hf_worker.py"), out, POLICY] + list(mode)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill(proc, out)
        text, _ = proc.communicate()
        raise AssertionError("the torchrun job did not finish in %d s:\n%s"
                             % (TIMEOUT, text[-6000:]))
    print("torchrun job: %.1f s" % (time.monotonic() - start))
    assert proc.returncode == 0, text[-8000:]
    ranks = []
    for r in range(WORLD):
        with open(os.path.join(out, "rank%d.json" % r)) as f:
            ranks.append(json.load(f))
        params = os.path.join(out, "rank%d.pt" % r)
        if os.path.exists(params):
            ranks[-1]["params"] = torch.load(params)
    return ranks, text


def test_import_stepguard_does_not_import_transformers():
    code = "import stepguard, sys; assert 'transformers' not in sys.modules, 'imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def _close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_trainer_ddp_gloo_two_ranks(tmp_path):
    # A framework that is missing fails the test, never skips it.
    import accelerate  # noqa: F401
    import transformers  # noqa: F401

    ranks, text = _run_ranks(str(tmp_path))
    params = [r["params"] for r in ranks]
    assert torch.isfinite(params[0]).all()
    assert torch.equal(params[0], params[1]), "the replicas parted"

    for r in ranks:
        rank = r["rank"]
        steps, logs = r["steps"], r["log_history"]
        max_steps, nan_step, grad_step, spike_step = (r["max_steps"], r["nan_step"],
                                                      r["grad_step"], r["spike_step"])
        bad = {nan_step: "skipped", grad_step: "skipped", spike_step: "rolled_back"}
        # Training went on to max_steps; each Trainer step was one guarded step.
        assert r["global_step"] == r["result_step"] == max_steps, rank
        assert [s["step"] for s in steps] == list(range(1, max_steps + 1)), rank
        assert [s["trainer_step"] for s in steps] == list(range(1, max_steps + 1)), rank
        assert [s["outcome"] for s in steps] == [bad.get(t, "applied")
                                                 for t in range(1, max_steps + 1)], rank
        applied = max_steps - len(bad)
        assert r["totals"]["applied"] == applied and r["totals"]["skipped"] == 2, r["totals"]
        assert r["totals"]["rolled_back"] == 1 and r["totals"]["aborted"] == 0, r["totals"]
        # The callback goes first, so reporters see its log entries.
        assert r["callback_order"][0] == "StepguardCallback", r["callback_order"]

        # The incidents, on every rank: who, what, which tensor.
        by_step = {s["step"]: s for s in steps}
        nan = by_step[nan_step]["incident"]
        assert (nan["signal"], nan["action"], nan["cause"]) == (
            "nonfinite_loss", "skip_batch", "forward"), nan
        assert nan["ranks"] == [r["nan_rank"]], nan  # only rank 1's loss was NaN
        grad = by_step[grad_step]["incident"]
        assert (grad["signal"], grad["action"], grad["cause"]) == (
            "nonfinite_grad", "skip_batch", "backward"), grad
        # The NaN entered rank 1's gradient before DDP averaged it: both ranks then hold it, in
        # that one tensor (the Trainer's clipping ran after the verdict, so it did not spread
        # the NaN to every tensor through the clip coefficient), and the incident names rank 1,
        # whose backward made it (not every rank the average reached).
        assert grad["tensors"] == [r["grad_tensor"]], grad
        assert grad["ranks"] == [r["grad_rank"]], grad
        spike = by_step[spike_step]["incident"]
        assert (spike["signal"], spike["action"]) == ("loss_spike", "rollback"), spike

        # The scheduler followed applied steps only: the LR each step ran with (logged by the
        # Trainer before its scheduler step) and the LR at the end.
        lr0 = r["lr"]
        train_logs = {e["step"]: e for e in logs if "loss" in e and "train_runtime" not in e}
        assert sorted(train_logs) == list(range(1, max_steps + 1)), sorted(train_logs)
        done = 0
        for t in range(1, max_steps + 1):
            expected = lr0 * (max_steps - done) / max_steps
            assert _close(train_logs[t]["learning_rate"], expected, 1e-9), (rank, t)
            done += by_step[t]["applied"]
        assert _close(r["final_lr"], lr0 * (max_steps - applied) / max_steps, 1e-9), r["final_lr"]

        for t in range(1, max_steps + 1):
            entry, report = train_logs[t], by_step[t]
            # stepguard's report in the Trainer's log history.
            assert entry["stepguard/outcome"] == report["outcome"], (rank, t)
            for key in ("grad_norm", "loss_scale", "lr_factor", "applied", "skipped",
                        "rolled_back", "incidents"):
                assert "stepguard/" + key in entry, (rank, t, key)
            assert entry["stepguard/lr_factor"] == 1.0 and entry["stepguard/loss_scale"] == 1.0
            if t in bad:
                [logged] = entry["stepguard/incident"]
                assert logged["step"] == t and logged["ranks"] == report["incident"]["ranks"]
                assert logged["tensors"] == report["incident"]["tensors"], (rank, t)
                continue
            assert "stepguard/incident" not in entry, (rank, t)
            # The grad norm the guard saw is the one the Trainer logs (both before clipping),
            # and the loss the guard saw is the one it logs (mean of the micro-batches, mean
            # over ranks).
            assert _close(report["grad_norm"], entry["grad_norm"], 1e-6), (rank, t)
            assert _close(entry["stepguard/grad_norm"], entry["grad_norm"], 1e-6), (rank, t)
            assert _close(report["loss"], entry["loss"], 1e-6), (rank, t)
            # ... and the update used clipped gradients all the same.
            clipped = min(report["grad_norm"], r["max_grad_norm"])
            assert _close(report["grad_norm_after_step"], clipped, 1e-4), (rank, t)
        # The spike: the guard saw it whole (no clip in front of the verdict).
        assert _close(by_step[spike_step]["grad_norm"], train_logs[spike_step]["grad_norm"],
                      1e-6)

    # Each rank its own trace, every guard step in it.
    for name in ("trace.jsonl", "trace.jsonl.rank1"):
        with open(os.path.join(str(tmp_path), name)) as f:
            assert len(f.read().splitlines()) >= ranks[0]["max_steps"], name

    # One line per incident for the job (rank 0, the guard's logger), naming the origin rank and
    # the tensors.
    line = "step %d: nonfinite_loss -> skip_batch (cause forward; tensors "
    nan_lines = [l for l in text.splitlines() if l.startswith(line % ranks[0]["nan_step"])]
    assert len(nan_lines) == 1 and nan_lines[0].endswith("; ranks 1)"), text[-6000:]
    line = "step %d: nonfinite_grad -> skip_batch (cause backward; tensors %s; ranks "
    grad_lines = [l for l in text.splitlines()
                  if l.startswith(line % (ranks[0]["grad_step"], ranks[0]["grad_tensor"]))]
    assert len(grad_lines) == 1, text[-6000:]
    # The batches the rollback drops are out of the guard's reach under the Trainer: said once
    # for the job.
    told = [l for l in text.splitlines() if "under the HF Trainer the data order is out of "
            "the guard's reach, so they are trained on (said once per run)" in l]
    assert len(told) == 1, text[-6000:]


def test_trainer_resume_on_two_ranks_in_new_processes_ends_bitwise_as_the_whole_run(tmp_path):
    """Two ranks save a Trainer checkpoint at step 6 (after the NaN steps 3 and 5); a new torchrun
    job resumes from it: steps 7-12 (the loss spike at 8 rolls back) and the end are those of the
    uninterrupted job, bitwise, the guard's figures included, on both ranks."""
    whole_dir, resumed_dir = str(tmp_path / "whole"), str(tmp_path / "resumed")
    os.makedirs(whole_dir)
    os.makedirs(resumed_dir)
    whole, _ = _run_ranks(whole_dir, "save")
    checkpoint = os.path.join(whole_dir, "trainer", "checkpoint-6")
    assert all(os.path.isfile(os.path.join(checkpoint, "stepguard_rank%d.pt" % r))
               for r in range(WORLD))
    resumed, _ = _run_ranks(resumed_dir, "resume", checkpoint)
    for w, r in zip(whole, resumed):
        assert torch.equal(w["params"], r["params"]), (
            [(s["step"], s["outcome"], s["actions"]) for s in w["steps"]],
            [(s["step"], s["outcome"], s["actions"]) for s in r["steps"]])
        assert w["totals"] == r["totals"], (w["totals"], r["totals"])
        assert w["final_lr"] == r["final_lr"]
        later = [s for s in w["steps"] if s["step"] > 6]
        assert [(s["step"], s["outcome"]) for s in r["steps"]] == [
            (s["step"], s["outcome"]) for s in later], r["steps"]


def test_trainer_fp16_follows_accelerates_grad_scaler_as_an_unguarded_twin(tmp_path):
    """TrainingArguments(fp16=True) on 2 ranks (accelerate's fp16 set up for CPU: see
    hf_worker.fp16_on_cpu), beside an unguarded twin on the same overflow schedule: the scaler's
    startup streak is skipped by the scaler's own path with the same scale trajectory and the
    same parameters bit for bit; the NaN loss (rank 1) and the NaN gradient element are skipped
    and blamed; the value spike is rolled back bit for bit; the LR scheduler steps on applied
    steps only (the twin's on every step: accelerate's scaler calls the fused AdamW on an
    overflow too); the guard's norm and loss are the Trainer's."""
    guarded_dir, twin_dir = str(tmp_path / "guarded"), str(tmp_path / "twin")
    os.makedirs(guarded_dir)
    os.makedirs(twin_dir)
    guarded, _ = _run_ranks(guarded_dir, "fp16")
    twin, _ = _run_ranks(twin_dir, "fp16-twin")
    assert torch.equal(guarded[0]["params"], guarded[1]["params"]), "the replicas parted"
    r0 = guarded[0]
    max_steps, nan_step, grad_step, spike_step = (r0["max_steps"], r0["nan_step"],
                                                  r0["grad_step"], r0["spike_step"])
    init = 2.0 ** 24
    scales = [init] + [s["scale"] for s in twin[0]["steps"]]
    overflow = [t for t in range(1, max_steps + 1) if scales[t] < scales[t - 1]]
    streak = next(t for t in range(1, max_steps + 1) if t not in overflow) - 1
    # The schedule the test needs: a streak first, the NaN steps overflows for the scaler, the
    # value spike not, the scaler growing in between.
    assert streak >= 3 and {nan_step, grad_step} <= set(overflow), (scales, overflow)
    assert spike_step not in overflow and any(
        scales[t] > scales[t - 1] for t in range(1, spike_step)), scales
    own = [t for t in range(1, max_steps + 1)
           if guarded[0]["steps"][t - 1]["scale"] < ([init] + [s["scale"] for s in
                                                                guarded[0]["steps"]])[t - 1]]
    assert [t for t in own if t < spike_step] == [t for t in overflow if t < spike_step]
    for r, plain in zip(guarded, twin):
        rank, steps, logs = r["rank"], r["steps"], r["log_history"]
        assert [s["trainer_step"] for s in steps] == list(range(1, max_steps + 1)), rank
        expected = {t: "skipped" for t in own}
        expected[spike_step] = "rolled_back"
        assert [s["outcome"] for s in steps] == [expected.get(t, "applied")
                                                 for t in range(1, max_steps + 1)], rank
        assert [s["skipped_by_trainer"] for s in steps] == [not s["applied"] for s in steps]
        for t in range(1, spike_step):
            s, p = steps[t - 1], plain["steps"][t - 1]
            assert (s["scale"], s["checksum"]) == (p["scale"], p["checksum"]), (rank, t)
            assert s["loss_scale"] == scales[t - 1], (rank, t, s)
        # The streak: the scaler's overflow; the faults: the policy's skips, blamed.
        for t in range(1, streak + 1):
            incident = steps[t - 1]["incident"]
            assert (incident["signal"], incident["cause"]) == ("overflow", "precision_overflow")
        nan = steps[nan_step - 1]["incident"]
        assert nan["signal"] == "nonfinite_loss" and nan["ranks"] == [r["nan_rank"]], nan
        grad = steps[grad_step - 1]["incident"]
        assert grad["signal"] == "overflow" and grad["tensors"] == [r["grad_tensor"]], grad
        spike = steps[spike_step - 1]
        assert spike["incident"]["signal"] == "loss_spike", spike
        back = spike["rolled_back_to"]  # a guard step is a Trainer step here
        assert 0 < back < spike_step and spike["checksum"] == steps[back - 1]["checksum"], spike
        # The LR schedule moved on applied steps only; the norm and loss are the Trainer's.
        applied = sum(s["applied"] for s in steps)
        assert r["totals"]["applied"] == applied and r["totals"]["rolled_back"] == 1
        assert r["scheduler_steps"] == applied and plain["scheduler_steps"] == max_steps
        train_logs = {e["step"]: e for e in logs if "loss" in e and "train_runtime" not in e}
        for t in range(1, max_steps + 1):
            if steps[t - 1]["applied"]:
                assert _close(steps[t - 1]["grad_norm"], train_logs[t]["grad_norm"], 1e-6)
                assert _close(steps[t - 1]["loss"], train_logs[t]["loss"], 1e-6), (rank, t)
            assert train_logs[t]["stepguard/loss_scale"] == steps[t - 1]["loss_scale"]
    assert twin[0]["totals"] is None

"""The real HF Trainer running DeepSpeed (TrainingArguments(deepspeed=...), accelerate's DeepSpeed
plugin: ZeRO 2, fp32, the Trainer's "auto" values) on 2 CPU ranks over Gloo under torchrun, guarded
by StepguardCallback.attach(trainer), which hands the Trainer's engine to the DeepSpeed
integration. hf_worker.py (each rank) injects the same faults as in test_transformers.py: a NaN
loss on rank 1, a NaN gradient element on rank 1, a loss spike on rank 0."""

import os

import pytest
import torch

from test_transformers import WORLD, _close, _run_ranks


@pytest.mark.parametrize("mode", ["ds", "ds-zero0", "ds-zero3", "ds-zero2-offload", "ds-bf16"],
                         ids=["zero2", "zero0", "zero3", "zero2-offload", "zero2-bf16"])
def test_trainer_over_deepspeed_skips_rolls_back_and_names_the_rank(tmp_path, mode):
    """ZeRO 2 (the Trainer's default DeepSpeed path), ZeRO 0 (the engine steps the Trainer's torch
    optimizer itself: accelerate's wrapper looked for its `overflow` at prepare(), before the
    guard gave it one), ZeRO 3, ZeRO 2 with the optimizer offloaded to the CPU, and ZeRO 2 under
    TrainingArguments(bf16=True)."""
    import deepspeed  # noqa: F401  (pinned: a missing one fails, never skips)
    ranks, text = _run_ranks(str(tmp_path), mode)
    assert torch.isfinite(ranks[0]["params"]).all()
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]), "the replicas parted"
    for r in ranks:
        rank, steps = r["rank"], r["steps"]
        max_steps, nan_step, grad_step, spike_step = (r["max_steps"], r["nan_step"],
                                                      r["grad_step"], r["spike_step"])
        assert r["engine"] == "DeepSpeedEngine"
        bad = {nan_step: "skipped", grad_step: "skipped", spike_step: "rolled_back"}
        assert r["global_step"] == max_steps
        assert [s["trainer_step"] for s in steps] == list(range(1, max_steps + 1)), rank
        assert [s["step"] for s in steps] == list(range(1, max_steps + 1)), rank
        assert [s["outcome"] for s in steps] == [bad.get(t, "applied")
                                                 for t in range(1, max_steps + 1)], rank
        applied = max_steps - len(bad)
        assert r["totals"]["applied"] == applied and r["totals"]["rolled_back"] == 1
        # Every step the guard did not apply took DeepSpeed's own overflow path.
        assert r["skipped_steps"] == len(bad), r["skipped_steps"]
        by_step = {s["step"]: s for s in steps}
        nan = by_step[nan_step]["incident"]
        assert (nan["signal"], nan["action"], nan["cause"]) == (
            "nonfinite_loss", "skip_batch", "forward") and nan["ranks"] == [r["nan_rank"]], nan
        grad = by_step[grad_step]["incident"]
        assert (grad["signal"], grad["cause"]) == ("nonfinite_grad", "backward"), grad
        assert grad["tensors"] == [r["grad_tensor"]], grad
        spike = by_step[spike_step]["incident"]
        assert (spike["signal"], spike["action"]) == ("loss_spike", "rollback"), spike
        assert spike["ranks"] == [r["spike_rank"]], spike
        # The LR schedule (stepped by the engine) followed applied steps only; the norm is
        # DeepSpeed's (get_global_grad_norm, which the Trainer logs), the loss the Trainer's.
        lr0 = r["lr"]
        logs = {e["step"]: e for e in r["log_history"] if "loss" in e and "train_runtime" not in e}
        done = 0
        # (With the config's optimizer the Trainer logs the LR after the engine's step.)
        after = mode == "ds-zero2-offload"
        for t in range(1, max_steps + 1):
            held = done + (by_step[t]["applied"] if after else 0)
            assert _close(logs[t]["learning_rate"], lr0 * (max_steps - held) / max_steps, 1e-9)
            assert logs[t]["stepguard/outcome"] == by_step[t]["outcome"], (rank, t)
            done += by_step[t]["applied"]
            if by_step[t]["applied"]:
                # (ZeRO 0 with a torch optimizer: DeepSpeed reports no norm, with or without
                # the guard, and the Trainer logs none.)
                if mode != "ds-zero0" or "grad_norm" in logs[t]:
                    assert _close(by_step[t]["grad_norm"], logs[t]["grad_norm"], 1e-6), (rank, t)
                assert _close(by_step[t]["loss"], logs[t]["loss"], 1e-6), (rank, t)
        assert r["scheduler_steps"] == applied
        assert r["left_after_detach"] == [], r["left_after_detach"]
    line = "step %d: nonfinite_loss -> skip_batch (cause forward; tensors "
    lines = [l for l in text.splitlines() if l.startswith(line % ranks[0]["nan_step"])]
    assert len(lines) == 1 and lines[0].endswith("; ranks 1)"), text[-6000:]


def test_trainer_over_deepspeed_clean_run_is_the_unguarded_twin_bitwise(tmp_path):
    """No faults and no clip: the guarded Trainer over DeepSpeed ends with the unguarded one's
    parameters bit for bit, its loss per step the same."""
    guarded_dir, twin_dir = str(tmp_path / "guarded"), str(tmp_path / "twin")
    os.makedirs(guarded_dir)
    os.makedirs(twin_dir)
    guarded, _ = _run_ranks(guarded_dir, "ds-clean")
    twin, _ = _run_ranks(twin_dir, "ds-twin")
    for g, t in zip(guarded, twin):
        assert torch.equal(g["params"], t["params"]), g["rank"]
        assert g["totals"]["applied"] == g["max_steps"] and t["totals"] is None
        logs = [[e for e in r["log_history"] if "loss" in e and "train_runtime" not in e]
                for r in (g, t)]
        assert [(e["step"], e["loss"]) for e in logs[0]] == [
            (e["step"], e["loss"]) for e in logs[1]]
        # The norm DeepSpeed reports is the guard's agreed one (fp64, summed once), DeepSpeed's
        # own within fp32 rounding.
        for mine, theirs in zip(*logs):
            assert _close(mine["grad_norm"], theirs["grad_norm"], 1e-6), (mine, theirs)


def test_trainer_over_deepspeed_resume_in_new_processes_ends_bitwise_as_the_whole_run(tmp_path):
    """The Trainer saves DeepSpeed's checkpoint and the guard's state file at step 6; a new
    torchrun job resumes from it (DeepSpeed's own load, then the guard's): steps 7-12, the
    rollback at 8 included, and the end are the uninterrupted job's, bitwise."""
    whole_dir, resumed_dir = str(tmp_path / "whole"), str(tmp_path / "resumed")
    os.makedirs(whole_dir)
    os.makedirs(resumed_dir)
    whole, _ = _run_ranks(whole_dir, "ds-save")
    checkpoint = os.path.join(whole_dir, "trainer", "checkpoint-6")
    assert os.path.isdir(os.path.join(checkpoint, "global_step6")), os.listdir(checkpoint)
    assert all(os.path.isfile(os.path.join(checkpoint, "stepguard_rank%d.pt" % r))
               for r in range(WORLD))
    resumed, _ = _run_ranks(resumed_dir, "ds-resume", checkpoint)
    for w, r in zip(whole, resumed):
        assert torch.equal(w["params"], r["params"]), r["rank"]
        assert w["totals"] == r["totals"], (w["totals"], r["totals"])
        assert w["final_lr"] == r["final_lr"] and w["skipped_steps"] == r["skipped_steps"]
        later = [(s["step"], s["outcome"]) for s in w["steps"] if s["step"] > 6]
        assert [(s["step"], s["outcome"]) for s in r["steps"]] == later, r["steps"]


def test_trainer_over_deepspeed_with_parameter_offload_is_refused_at_attach(tmp_path):
    ranks, _ = _run_ranks(str(tmp_path), "ds-offload")
    for r in ranks:
        assert "offload to NVMe, or of the parameters" in r["refused"], r
        assert "StepguardCallback" not in r["callbacks"], r  # nothing was changed

"""The real Lightning with DeepSpeedStrategy(stage=2) and StepguardCallback, 2 CPU processes over
Gloo, 2 accumulated micro-batches per step, AdamW with a step-interval StepLR, clip by norm: a NaN
loss on rank 1 and a loss spike on rank 0 at later steps; a clean run beside an unguarded twin;
the checkpoint the run saves at step 6 during training (DeepSpeed's, the guard's state in the
callback's) resumed in new processes. The faults also under DeepSpeedStrategy(stage=3) and
DeepSpeedStrategy(stage=2, offload_optimizer=True) with DeepSpeedCPUAdam (Lightning's way for
ZeRO-Offload; DeepSpeed builds its C++ op on first use).

Test-only CPU shim (``CPUDeepSpeedStrategy``): Lightning's DeepSpeedStrategy runs on CUDA only;
the shim leaves out its CUDA check (``setup_environment``) and its GPU index check
(``setup_distributed``) and gives each rank ``torch.device("cpu", local_rank)`` as its root
device (DeepSpeed reads the index as the rank's device). Nothing else of Lightning or DeepSpeed
is changed.

This file is also the training script: the test runs ``python test_lightning_deepspeed.py OUT
MODE``, and Lightning's launcher starts rank 1 by running the same command again."""

import hashlib
import os
import sys
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402

from test_lightning import leave, run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
STEPS, SAVE_AT, ACCUM = 12, 6, 2  # optimizer steps; an epoch is SAVE_AT steps
NAN_AT, SPIKE_AT = 3, 8           # trainer.global_step of the faulty step
LR, GAMMA, CLIP = 0.01, 0.9, 1.0


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """The test-only CPU shim (see the module's docstring)."""

    def setup_environment(self):
        DDPStrategy.setup_environment(self)

    def setup_distributed(self):
        from lightning.fabric.utilities.seed import reset_seed
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self):
        return torch.device("cpu", self.local_rank)


class Net(pl.LightningModule):
    def __init__(self, faults, cpu_adam=False):
        super().__init__()
        torch.manual_seed(0)
        self.faults = faults
        self.cpu_adam = cpu_adam
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.body(x)), y)
        if self.faults and batch_idx % ACCUM == 0:
            if self.global_step == NAN_AT and self.global_rank == 1:
                loss = loss * float("nan")
            if self.global_step == SPIKE_AT and self.global_rank == 0:
                loss = loss * 1e4
        return loss

    def configure_optimizers(self):
        if self.cpu_adam:  # what Lightning's docs give ZeRO-Offload: DeepSpeed's host Adam
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam(self.parameters(), lr=LR, adamw_mode=True)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAVE_AT * ACCUM * 2 * 8, 8, generator=g)  # one epoch: SAVE_AT steps
        y = x[:, :1] * 0.5 + 0.1 * torch.randn(len(x), 1, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8,
                                           sampler=torch.utils.data.DistributedSampler(
                                               torch.utils.data.TensorDataset(x, y),
                                               shuffle=False))


def _gathered(module):
    """The whole parameters for a moment (ZeRO 3's all-gather, every rank together); the
    parameters themselves elsewhere."""
    import deepspeed
    return deepspeed.zero.GatheredParameters(list(module.parameters()))


class SaveAt(pl.Callback):
    """A checkpoint after optimizer step SAVE_AT, during training (as ModelCheckpoint saves)."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == SAVE_AT and (batch_idx + 1) % ACCUM == 0:
            trainer.save_checkpoint(self.folder)


class Recorder(pl.Callback):
    """After each optimizer step: the guard's report, the engine's counts, the LR and a checksum
    of the parameters."""

    def __init__(self, guard_callback):
        self.sg = guard_callback
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % ACCUM:
            return
        engine = trainer.strategy.model
        digest = hashlib.sha256()
        with _gathered(pl_module):  # ZeRO 3: each rank holds a partition
            for _, p in pl_module.named_parameters():
                digest.update(p.detach().numpy().tobytes())
        r = self.sg.last_report if self.sg is not None else None
        norm = engine.get_global_grad_norm()
        self.steps.append({
            "global_step": trainer.global_step, "engine_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps, "checksum": digest.hexdigest(),
            "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0],
            "ds_norm": None if norm is None else float(norm),
            "step": r and r.step, "outcome": r and r.outcome, "applied": r and r.applied,
            "grad_norm": r and r.grad_norm, "incident": r and r.incident and {
                k: r.incident[k] for k in ("signal", "action", "ranks")}})


def train(out, mode):
    """mode: faults | resume | clean | twin (ZeRO 2), or faults-zero3 | faults-offload (ZeRO 3;
    ZeRO 2 with the optimizer offloaded to the CPU)."""
    from stepguard.integrations.lightning import StepguardCallback

    mode, _, layout = mode.partition("-")

    torch.set_num_threads(1)
    guarded = mode != "twin"
    sg = StepguardCallback(policy=str(HERE / "policy.yaml"), collective_timeout=30) \
        if guarded else None
    recorder = Recorder(sg)
    callbacks = [c for c in (sg, recorder) if c is not None]
    if mode == "faults":
        callbacks.append(SaveAt(os.path.join(out, "step%d" % SAVE_AT)))
    ckpt = os.path.join(out, "..", "faults", "step%d" % SAVE_AT) if mode == "resume" else None
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS,
        strategy=CPUDeepSpeedStrategy(stage=3 if layout == "zero3" else 2,
                                      offload_optimizer=layout == "offload",
                                      process_group_backend="gloo",
                                      timeout=timedelta(seconds=60)),
        accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP if mode != "twin" and mode !=
        "clean" else None, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out)
    model = Net(faults=mode in ("faults", "resume"), cpu_adam=layout == "offload")
    trainer.fit(model, ckpt_path=ckpt)
    engine = trainer.strategy.model
    with _gathered(model):
        flat = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    torch.save({"steps": recorder.steps, "params": flat,
                "totals": sg.guards[0].stats().totals.to_dict() if sg else None,
                "step_count": sg.guards[0].stats().step_count if sg else None,
                "incidents": sg.incidents if sg else None,
                "scheduler_steps": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
                "left_in_engine": [n for n in ("backward", "scale") if n in vars(engine)]},
               os.path.join(out, "rank%d.pt" % trainer.global_rank))


# --- the tests -----------------------------------------------------------------------------
def _ranks(out, mode):
    os.makedirs(out, exist_ok=True)
    text = run_ranks(out, timeout=240, mode=mode, script=__file__)
    ranks = [torch.load(os.path.join(out, "rank%d.pt" % r), weights_only=False) for r in (0, 1)]
    ranks[0]["output"] = text
    return ranks


def _outcomes(steps):
    return [s["outcome"] for s in steps]


def test_lightning_deepspeed_zero2_skips_rolls_back_holds_the_schedule_and_resumes(tmp_path):
    """Then the checkpoint of step 6 is resumed in new processes: steps 7-12 (the rollback at 9
    included) and the end are the uninterrupted run's, bitwise, and the guard's counts go on
    (Lightning restores the callback's state after on_fit_start under DeepSpeed: the guard goes
    into the engine at train start)."""
    ranks = _ranks(str(tmp_path / "faults"), "faults")
    _check_faults(ranks)
    resumed = _ranks(str(tmp_path / "resumed"), "resume")
    for w, r in zip(ranks, resumed):
        assert torch.equal(w["params"], r["params"])
        assert w["totals"] == r["totals"] and r["step_count"] == STEPS
        later = [(s["step"], s["outcome"], s["checksum"]) for s in w["steps"][SAVE_AT:]]
        assert [(s["step"], s["outcome"], s["checksum"]) for s in r["steps"]] == later


@pytest.mark.parametrize("layout", ["zero3", "offload"])
def test_lightning_deepspeed_zero3_and_offload_skip_and_roll_back(tmp_path, layout):
    """DeepSpeedStrategy(stage=3), and DeepSpeedStrategy(stage=2, offload_optimizer=True): the
    same faults, skipped and rolled back on every rank, the schedule held."""
    _check_faults(_ranks(str(tmp_path / layout), "faults-" + layout))


def _check_faults(ranks):
    expected = ["applied"] * STEPS
    expected[NAN_AT], expected[SPIKE_AT] = "skipped", "rolled_back"
    applied = expected.count("applied")
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]), "the replicas parted"
    for r, got in enumerate(ranks):
        steps = got["steps"]
        assert _outcomes(steps) == expected, (r, steps)
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        assert [s["engine_steps"] for s in steps] == list(range(1, STEPS + 1))
        # Every step the guard did not apply took DeepSpeed's own overflow path.
        assert steps[-1]["skipped_steps"] == 2 and got["totals"]["applied"] == applied
        nan, spike = steps[NAN_AT]["incident"], steps[SPIKE_AT]["incident"]
        assert nan["signal"] == "nonfinite_loss" and nan["ranks"] == [1], nan
        assert spike["signal"] == "loss_spike" and spike["action"] == "rollback", spike
        assert spike["ranks"] == [0], spike
        sums = [s["checksum"] for s in steps]
        assert sums[NAN_AT] == sums[NAN_AT - 1]
        # The step scheduler moved on applied steps only (Lightning steps it; the callback
        # holds it), and DeepSpeed's norm is the guard's on applied steps.
        assert got["scheduler_steps"] == applied
        lr = LR
        for s in steps:
            lr *= GAMMA if s["applied"] else 1.0
            assert abs(s["lr"] - lr) <= 1e-12, (r, steps)
            if s["applied"]:
                assert abs(s["ds_norm"] - s["grad_norm"]) <= 1e-6 * s["grad_norm"], s
        assert got["left_in_engine"] == [], got["left_in_engine"]  # detached at teardown
    # The batches the rollback drops are out of the guard's reach here: said once for the job.
    told = [l for l in ranks[0]["output"].splitlines() if "under Lightning's DeepSpeedStrategy "
            "the data order is out of the guard's reach" in l]
    assert len(told) == 1, ranks[0]["output"][-4000:]


def test_lightning_deepspeed_clean_run_is_the_unguarded_twin_bitwise(tmp_path):
    guarded = _ranks(str(tmp_path / "clean"), "clean")
    twin = _ranks(str(tmp_path / "twin"), "twin")
    for g, t in zip(guarded, twin):
        assert torch.equal(g["params"], t["params"])
        assert [s["checksum"] for s in g["steps"]] == [s["checksum"] for s in t["steps"]]
        assert g["totals"]["applied"] == STEPS and t["totals"] is None


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2])
    leave()

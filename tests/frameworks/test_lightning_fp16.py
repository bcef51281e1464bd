"""The real Lightning with precision '16-mixed' (its MixedPrecision plugin and torch's GradScaler)
and stepguard's StepguardCallback, beside an unguarded twin: Trainer(strategy="ddp") on CPU,
2 processes, Gloo, SGD with momentum and a step-interval scheduler, no gradient clip (so the
applied updates do not depend on who computed the norm).

On a GPU, precision='16-mixed' builds MixedPrecision('16-mixed', 'cuda'), whose GradScaler is
torch.amp.GradScaler('cuda'). On CPU Lightning turns '16-mixed' into bf16; the one mapping here
is that the test passes the plugin Lightning would build, for device 'cpu':
MixedPrecision('16-mixed', 'cpu', GradScaler('cpu', init_scale=2**24)), so that autocast runs
fp16 and the scaler is the real one. The initial scale is far too high: the first steps overflow
in fp16 and the scaler backs off. Then a NaN loss on rank 1 alone, and a loss whose value
spikes on every rank (its gradient as usual: a 1e4 times larger fp16 gradient would be one more
overflow, the scaler's).

This file is also the training script: `python test_lightning_fp16.py OUT MODE` (MODE
"guarded" or "twin"); Lightning's launcher starts rank 1 by running the same command again."""

import hashlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_lightning import LR, Net, leave, pl, run_ranks  # noqa: E402  (the DDP run's model)

STEPS = 16
NAN_AT = 10     # trainer.global_step of the batch whose loss is NaN on rank 1
SPIKE_AT = 13   # ... of the batch whose loss value is 1e4 times larger on both ranks
INIT_SCALE = 2.0 ** 24
GROWTH_INTERVAL = 3


class HalfNet(Net):
    steps = STEPS
    # A step scheduler that leaves the LR as it is: Lightning steps it after every optimizer
    # step, also after one its GradScaler skipped (the twin's LR would move on its overflow
    # steps, the guarded run's not), and the twin is compared bit for bit.
    gamma = 1.0
    hook_at = None  # no NaN from the module's own hook here (test_lightning.py has that)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.body(x)).float(), y)
        if self.global_step == NAN_AT and self.global_rank == 1:
            loss = loss + float("nan") * self.head.weight.sum()  # NaN grad in head.weight
        if self.global_step == SPIKE_AT:
            loss = loss + 1e4 * loss.detach()
        return loss


class Recorder(pl.Callback):
    """After each batch: the scaler's scale, the loss, a checksum of the parameters, Lightning's
    own grad norm (after the scaler's unscale_), and the guard's report when there is a guard."""

    def __init__(self, guard_callback=None):
        self.guard_callback = guard_callback
        self.steps = []
        self.lightning_norm = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning.pytorch.utilities import grad_norm
        self.lightning_norm = float(grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        digest = hashlib.sha256()
        for _, p in pl_module.named_parameters():
            digest.update(p.detach().numpy().tobytes())
        row = {"scale": trainer.precision_plugin.scaler.get_scale(),
               "loss": float(outputs["loss"]), "checksum": digest.hexdigest(),
               "lightning_norm": self.lightning_norm,
               "lr": trainer.optimizers[0].param_groups[0]["lr"]}
        if self.guard_callback is not None:
            report = self.guard_callback.guards[0].last_report
            row.update(outcome=report.outcome if report is not None else "dropped",
                       report=None if report is None else {
                           "loss_scale": report.loss_scale, "grad_norm": report.grad_norm,
                           "loss": report.loss, "rolled_back_to": report.rolled_back_to})
        self.steps.append(row)
        self.lightning_norm = None


def train(out, mode):
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy
    from stepguard.integrations.lightning import StepguardCallback

    torch.set_num_threads(1)
    callbacks = []
    guard_cb = None
    if mode == "guarded":
        guard_cb = StepguardCallback(policy=str(HERE / "policy.yaml"), collective_timeout=30)
        callbacks.append(guard_cb)
    recorder = Recorder(guard_cb)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS, max_epochs=1,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        callbacks=callbacks + [recorder], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=out)
    model = HalfNet()
    trainer.fit(model)
    got = {"steps": recorder.steps,
           "scheduler_steps": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
           "finite": all(bool(p.isfinite().all()) for p in model.parameters())}
    if guard_cb is not None:
        guard = guard_cb.guards[0]
        got.update(incidents=guard_cb.incidents, totals=guard.stats().totals.to_dict(),
                   plugin_left="optimizer_step" in trainer.precision_plugin.__dict__)
    torch.save(got, os.path.join(out, "rank%d.pt" % trainer.global_rank))


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2])
    leave()


def _ranks(out, mode):
    out.mkdir()
    run_ranks(out, mode=mode, script=__file__)
    return [torch.load(out / ("rank%d.pt" % r), weights_only=False) for r in (0, 1)]


def test_lightning_16_mixed_follows_its_grad_scaler_as_an_unguarded_twin(tmp_path):
    start = time.monotonic()
    guarded = _ranks(tmp_path / "guarded", "guarded")
    twin = _ranks(tmp_path / "twin", "twin")
    def overflows(steps):  # the steps after which the scaler backed off
        scales = [INIT_SCALE] + [s["scale"] for s in steps]
        return scales, [i for i in range(STEPS) if scales[i + 1] < scales[i]]

    scales, overflow = overflows(twin[0]["steps"])
    # The schedule this test needs: a streak at the start, the NaN step an overflow (NaN in the
    # gradients), the spike step not, and the scaler growing its scale in between.
    streak = next(i for i in range(STEPS) if i not in overflow)
    assert streak >= 3, scales
    assert NAN_AT in overflow and SPIKE_AT not in overflow, overflow
    assert any(scales[i + 1] > scales[i] for i in range(SPIKE_AT)), scales
    # After the rollback the guarded run trains on other parameters than the twin: its own
    # scaler's backoffs tell its overflow steps there.
    own = overflows(guarded[0]["steps"])[1]
    assert [i for i in own if i < SPIKE_AT] == [i for i in overflow if i < SPIKE_AT], own
    expected = ["skipped" if i in own else "applied" for i in range(STEPS)]
    expected[SPIKE_AT], expected[SPIKE_AT + 1] = "rolled_back", "dropped"
    for r, got in enumerate(guarded):
        steps, plain = got["steps"], twin[r]["steps"]
        assert [s["outcome"] for s in steps] == expected, (r, [s["outcome"] for s in steps])
        assert got["finite"] and not got["plugin_left"], r
        # Up to the spike: the same scale trajectory, the same parameters bit for bit (the
        # skipped steps are the scaler's own), the guard reporting the scale of each step's
        # backward and the loss unscaled.
        for i in range(SPIKE_AT):
            assert steps[i]["scale"] == plain[i]["scale"], (r, i)
            assert steps[i]["checksum"] == plain[i]["checksum"], (r, i)
            assert steps[i]["report"]["loss_scale"] == scales[i], (r, i, steps[i])
            if i != NAN_AT:
                mean = (guarded[0]["steps"][i]["loss"] + guarded[1]["steps"][i]["loss"]) / 2
                assert steps[i]["report"]["loss"] == pytest.approx(mean, rel=1e-5), (r, i)
            if expected[i] == "applied":  # Lightning's own norm, after the scaler's unscale_
                assert steps[i]["report"]["grad_norm"] == pytest.approx(
                    steps[i]["lightning_norm"], rel=1e-6), (r, i, steps[i])
        # The spike rolled back bit for bit to the snapshot it names; the next batch dropped.
        back = steps[SPIKE_AT]["report"]["rolled_back_to"]
        assert 0 < back <= SPIKE_AT
        assert steps[SPIKE_AT]["checksum"] == steps[back - 1]["checksum"], (r, back)
        assert steps[SPIKE_AT + 1]["checksum"] == steps[SPIKE_AT]["checksum"]
        # The scheduler moved on applied steps only (the twin's moves on every step).
        applied = expected.count("applied")
        assert got["scheduler_steps"] == applied and twin[r]["scheduler_steps"] == STEPS
        totals = got["totals"]
        assert totals["applied"] == applied and totals["rolled_back"] == 1
        assert totals["skipped"] == expected.count("skipped")
        # The incidents: an overflow on each step of the streak (the scaler's, only skipped),
        # the NaN from rank 1 in head.weight (the policy's skip), the spike rolled back.
        incidents = got["incidents"]
        for step, incident in zip(range(streak), incidents):
            assert incident["step"] == step + 1 and incident["signal"] == "overflow", incident
            assert incident["cause"] == "precision_overflow", incident
        (nan,) = [i for i in incidents if i["step"] == NAN_AT + 1]
        assert nan["signal"].startswith("nonfinite") and nan["ranks"] == [1], nan
        assert "head.weight" in nan["tensors"], nan
        (spike,) = [i for i in incidents if i["step"] == SPIKE_AT + 1]
        assert spike["signal"] == "loss_spike" and spike["action"] == "rollback", spike
    # Every rank, every step: the same parameters and scale.
    for a, b in zip(guarded[0]["steps"], guarded[1]["steps"]):
        assert (a["checksum"], a["scale"]) == (b["checksum"], b["scale"])
    print("lightning 16-mixed runs: %.1f s" % (time.monotonic() - start))


class ManualNet(HalfNet):
    """Manual optimization under '16-mixed': the user's training_step steps the guard and reads
    each step's report."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.reports = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.body(x)).float(), y)
        opt.zero_grad()
        self.manual_backward(loss)
        self.reports.append(opt.step())


def test_lightning_16_mixed_manual_optimization_gets_a_report_from_every_step(tmp_path):
    """opt.step() returns the StepReport also on a step the GradScaler left out (the startup
    overflow streak), one process."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from stepguard.integrations.lightning import StepguardCallback

    torch.set_num_threads(1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    guard_cb = StepguardCallback(policy=str(HERE / "policy.yaml"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10, max_epochs=1,
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                         callbacks=[guard_cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    model = ManualNet()
    trainer.fit(model)
    outcomes = [r.outcome for r in model.reports]  # a report every step, None never
    assert len(outcomes) == 10 and outcomes[0] == "skipped" and "applied" in outcomes, outcomes
    assert all(r.loss_scale >= 1.0 for r in model.reports)
    assert guard_cb.guards[0].stats().totals.to_dict()["steps"] == 10

"""The real Lightning (lightning.pytorch) with stepguard's StepguardCallback: Trainer(strategy=
"ddp") on CPU, 2 processes, Gloo, automatic optimization, SGD with momentum and a step-interval
StepLR. A NaN loss on rank 1 alone at one step (its gradient NaN in head.weight only), a NaN put
into a gradient by rank 1's LightningModule in its own on_before_optimizer_step (which Lightning
runs after the callbacks') and a loss spike on every rank at a later one; each rank writes what it
saw, and the test checks every rank. The same module hook under ModelParallelStrategy (FSDP2).

This file is also the training script: the test runs it as `python test_lightning.py OUT`, and
Lightning's subprocess launcher starts rank 1 by running the same command again."""

import csv
import hashlib
import math
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

try:
    import lightning.pytorch as pl
except ImportError as e:  # a framework that is missing fails the test, never skips it
    raise ImportError("tests/frameworks needs lightning (requirements.txt pins 2.6.6)") from e

HERE = Path(__file__).resolve().parent
STEPS = 12
NAN_AT = 3      # trainer.global_step of the batch whose gradient (DDP) or loss (FSDP2) rank 1
                # makes NaN
SPIKE_AT = 8    # ... of the batch whose loss is 1e4 times larger on both ranks
HOOK_AT = 10    # ... of the batch whose gradient rank 1's LightningModule hook makes NaN
SHARDED_STEPS = 6  # the FSDP2 run: up to the NaN step and a few after
SHARDED_HOOK_AT = 5  # its batch whose gradient shard rank 1's module hook makes NaN
GAMMA = 0.9
LR = 0.05


# --- the training script (each rank) -------------------------------------------------------
class Net(pl.LightningModule):
    steps = STEPS    # batches in its data
    gamma = GAMMA    # its step scheduler's factor
    hook_at = HOOK_AT  # the batch whose gradient rank 1's own on_before_optimizer_step makes NaN
    grad_fault = True  # NAN_AT's NaN made in rank 1's backward (the loss finite), else its loss

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                        torch.nn.Linear(32, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 1)
        if self.grad_fault:  # a user's hook on the parameter: before DDP averages the gradient
            self.head.weight.register_hook(self._nan_gradient)

    def _nan_gradient(self, grad):
        if self.global_step == NAN_AT and self.global_rank == 1:
            return grad * float("nan")  # head.weight's gradient only, on rank 1 only
        return grad

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.body(x)), y)
        if self.global_step == NAN_AT and self.global_rank == 1 and not self.grad_fault:
            loss = loss + float("nan") * self.head.weight.sum()  # NaN loss and head.weight grad
        if self.global_step == SPIKE_AT:
            loss = loss * 1e4
        return loss

    def on_before_optimizer_step(self, optimizer):
        # The module's own hook runs after the callbacks' (a user's clipping or noise): what it
        # does to the gradients is what the update applies, and the guard judges.
        if self.global_step == self.hook_at and self.global_rank == 1:
            grad = self.body[0].weight.grad
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            grad.view(-1)[0] = float("nan")

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=self.gamma)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(self.steps * 2 * 8, 8, generator=g)
        y = x[:, :1] * 0.5 + 0.1 * torch.randn(len(x), 1, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Recorder(pl.Callback):
    """After each batch: the guard's outcome, the LR, a checksum of the parameters, and the grad
    norm stepguard reported beside Lightning's own (``lightning.pytorch.utilities.grad_norm``,
    taken in ``on_before_optimizer_step``, as Lightning's docs log it)."""

    def __init__(self, guard_callback):
        self.guard_callback = guard_callback
        self.steps = []
        self.lightning_norm = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning.pytorch.utilities import grad_norm
        self.lightning_norm = float(grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        guard = self.guard_callback.guards[0]
        report = guard.last_report
        digest = hashlib.sha256()
        for _, p in pl_module.named_parameters():
            digest.update(p.detach().cpu().numpy().tobytes())
        self.steps.append({
            "outcome": report.outcome if report is not None else "dropped",
            "rolled_back_to": report.rolled_back_to if report is not None else None,
            "lr": trainer.optimizers[0].param_groups[0]["lr"], "checksum": digest.hexdigest(),
            "grad_norm": report.grad_norm if report is not None else None,
            "lightning_norm": self.lightning_norm})
        self.lightning_norm = None


def train(out):
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy
    from stepguard.integrations.lightning import StepguardCallback

    torch.set_num_threads(1)
    # One trace_path for both ranks: rank 0 writes it, rank 1 trace.jsonl.rank1.
    guard_cb = StepguardCallback(policy=str(HERE / "policy.yaml"), collective_timeout=30,
                                 trace_path=os.path.join(out, "trace.jsonl"))
    recorder = Recorder(guard_cb)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS, max_epochs=1,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        callbacks=[guard_cb, recorder], logger=CSVLogger(out, name="csv", version=0),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out)
    model = Net()
    trainer.fit(model)
    trainer.save_checkpoint(os.path.join(out, "last.ckpt"), weights_only=False)
    guard = guard_cb.guards[0]
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    torch.save({"steps": recorder.steps, "incidents": guard_cb.incidents, "totals": guard.stats().totals.to_dict(),
                "dropped": guard.dropped, "global_step": trainer.global_step,
                "scheduler_steps": scheduler.last_epoch,
                "finite": all(bool(p.isfinite().all()) for p in model.parameters()),
                "hook_left": "lr_scheduler_step" in model.__dict__},
               os.path.join(out, "rank%d.pt" % trainer.global_rank))


# --- the test ------------------------------------------------------------------------------
def run_ranks(out, timeout=150, mode=None, script=__file__):
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
    for name in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(name, None)
    paths = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)  # the stepguard under test, from any directory
    proc = subprocess.Popen([sys.executable, script, str(out)] + ([mode] if mode else []),
                            env=env, cwd=str(out),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # rank 1 is rank 0's child: one group
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        raise AssertionError("the Lightning run did not finish in %d s:\n%s" % (timeout, text))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the run outlives the test
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, text
    return text


def test_lightning_ddp_gloo_two_ranks(tmp_path):
    start = time.monotonic()
    text = run_ranks(tmp_path)
    ranks = [torch.load(tmp_path / ("rank%d.pt" % r), weights_only=False) for r in (0, 1)]

    guard_steps = STEPS - 1  # the batch after the rollback is dropped: no guard step
    expected = ["applied"] * STEPS
    expected[NAN_AT], expected[HOOK_AT], expected[SPIKE_AT], expected[SPIKE_AT + 1] = (
        "skipped", "skipped", "rolled_back", "dropped")
    applied = expected.count("applied")
    for r, got in enumerate(ranks):
        steps = got["steps"]
        assert [s["outcome"] for s in steps] == expected, (r, steps)
        assert got["global_step"] == STEPS and got["finite"] and not got["hook_left"], r
        assert got["totals"]["steps"] == guard_steps and got["totals"]["applied"] == applied
        assert got["totals"]["skipped"] == 2 and got["totals"]["rolled_back"] == 1
        assert got["dropped"] == 1
        sums = [s["checksum"] for s in steps]
        # A skipped step and a dropped batch leave the parameters as they were; the rollback
        # goes back to the snapshot of guard step 6 (snapshots every 2 steps; the one of step 8,
        # right before the spike, is not confirmed), i.e. the parameters after batch 5.
        assert sums[NAN_AT] == sums[NAN_AT - 1] and sums[SPIKE_AT + 1] == sums[SPIKE_AT]
        assert sums[HOOK_AT] == sums[HOOK_AT - 1]
        assert steps[SPIKE_AT]["rolled_back_to"] == 6 and sums[SPIKE_AT] == sums[5]
        assert len(set(sums)) == len(sums) - 4
        # The scheduler moved on applied steps only: StepLR(gamma) once per applied step.
        assert got["scheduler_steps"] == applied
        lr = LR
        for s in steps:
            if s["outcome"] == "applied":
                lr *= GAMMA
            assert abs(s["lr"] - lr) <= 1e-12 * LR, (r, steps)
        # On every applied step stepguard's grad norm is Lightning's own (its grad_norm utility
        # works in float32: 1e-6 relative).
        for s in steps:
            if s["outcome"] == "applied":
                assert s["lightning_norm"] == pytest.approx(s["grad_norm"], rel=1e-6), (r, s)
        # The incidents: the NaN rank 1's backward made in head.weight (the loss finite), then
        # the spike everywhere. DDP's average put the NaN into both ranks' gradients; the gradient
        # watch, before the average, names rank 1 alone (without it: ranks [0, 1]).
        nan, spike, hook = got["incidents"]
        assert nan["signal"] == "nonfinite_grad" and nan["action"] == "skip_batch", nan
        assert nan["ranks"] == [1] and "head.weight" in nan["tensors"], nan
        assert r == 1 or "the fault came from rank 1" in nan["evidence"][0], nan
        assert hook["ranks"] == [1] and hook["action"] == "skip_batch", hook
        assert r == 0 or "body.0.weight" in hook["tensors"], hook  # each rank names its own
        assert spike["signal"] == "loss_spike" and spike["action"] == "rollback", spike
    # Every rank, every step: the same parameters, bit for bit.
    assert [s["checksum"] for s in ranks[0]["steps"]] == [s["checksum"] for s in ranks[1]["steps"]]

    # The incident line, once for the job (rank 0, the guard's logger).
    lines = [l for l in text.splitlines() if l.startswith("step 4: nonfinite")]
    assert len(lines) == 1 and "ranks 1)" in lines[0] and "head.weight" in lines[0], text

    # stepguard's metrics reached Lightning's logger: the CSVLogger's file, one row per step.
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("stepguard/outcome")]
    assert [int(row["step"]) for row in rows] == list(range(STEPS)), rows
    codes = {"applied": 0, "skipped": 1, "rolled_back": 2, "aborted": 3, "dropped": 4}
    assert [int(float(row["stepguard/outcome"])) for row in rows] == [codes[o] for o in expected]
    assert [float(row["stepguard/lr_factor"]) for row in rows] == [1.0] * STEPS
    assert [float(row["stepguard/loss_scale"]) for row in rows] == [1.0] * STEPS
    norms = [float(row["stepguard/grad_norm"]) for row in rows]
    assert norms[SPIKE_AT] > 100 * norms[5] and math.isnan(norms[SPIKE_AT + 1]), norms
    assert int(float(rows[NAN_AT]["stepguard/nonfinite_count"])) > 0
    assert [int(float(row["stepguard/incidents"])) for row in rows][NAN_AT - 1:NAN_AT + 1] == [0, 1]
    assert int(float(rows[-1]["stepguard/incidents"])) == 3
    assert int(float(rows[-1]["stepguard/rolled_back"])) == 1
    assert int(float(rows[-1]["stepguard/dropped"])) == 1

    # Each rank its own trace, every guard step in it.
    for name in ("trace.jsonl", "trace.jsonl.rank1"):
        lines = (tmp_path / name).read_text().splitlines()
        assert len(lines) >= guard_steps, (name, lines)

    # The checkpoint: the optimizer's state as plain SGD's, the guard's in the callback's state.
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert set(ckpt["optimizer_states"][0]) == {"state", "param_groups"}
    (records,) = [v["records"] for k, v in ckpt["callbacks"].items() if "StepguardCallback" in k]
    assert len(records) == 1 and records[0]["step"] == guard_steps
    print("lightning DDP run: %.1f s" % (time.monotonic() - start))


def test_lightning_model_parallel_fsdp2_is_guarded_without_being_told(tmp_path):
    """ModelParallelStrategy (FSDP2) on 2 CPU ranks, the callback as in the DDP run: it sees the
    DTensors itself (no sharded_gradients=True), sums the shards' norms over ranks, and skips
    rank 1's NaN on both ranks."""
    start = time.monotonic()
    run_ranks(tmp_path, mode="sharded")
    ranks = [torch.load(tmp_path / ("rank%d.pt" % r), weights_only=False) for r in (0, 1)]
    expected = ["applied"] * SHARDED_STEPS
    expected[NAN_AT] = expected[SHARDED_HOOK_AT] = "skipped"
    for r, got in enumerate(ranks):
        steps = got["steps"]
        assert got["finite"], r  # (the run itself: without sharded_gradients it is refused)
        assert [s["outcome"] for s in steps] == expected, (r, steps)
        assert got["totals"]["skipped"] == 2 and got["totals"]["applied"] == SHARDED_STEPS - 2
        for s in steps:
            if s["outcome"] == "applied":
                assert s["grad_norm"] == pytest.approx(s["full_norm"], rel=1e-6), (r, s)
        sums = [s["checksum"] for s in steps]
        assert sums[NAN_AT] == sums[NAN_AT - 1]
        assert sums[SHARDED_HOOK_AT] == sums[SHARDED_HOOK_AT - 1]
        nan, hook = got["incidents"]
        assert nan["ranks"] == [1] and nan["action"] == "skip_batch", nan
        # The NaN the LightningModule's own hook put into rank 1's shard, judged and skipped.
        # ... written into rank 1's shard after the reduce-scatter: FSDP2's gradients get no hook
        # before it, so which rank made it is not known (the evidence names the shard's rank).
        assert hook["ranks"] == [] and hook["origin_unknown"], hook
        assert "body.0.weight" in hook["tensors"], hook
        assert any("not known" in e and e.endswith("on rank 1") for e in hook["evidence"]), hook
    assert [s["checksum"] for s in ranks[0]["steps"]] == [s["checksum"] for s in ranks[1]["steps"]]
    print("lightning FSDP2 run: %.1f s" % (time.monotonic() - start))


def fit(root, steps, guard=True, ckpt_path=None):
    """One process, no DDP: ``steps`` steps in all, from ``ckpt_path`` if given."""
    from stepguard.integrations.lightning import StepguardCallback

    callbacks = [StepguardCallback(policy=str(HERE / "policy.yaml"))] if guard else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps,
                         callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(root))
    model = Net()
    trainer.fit(model, ckpt_path=ckpt_path, weights_only=False)
    path = str(root / ("after%d.ckpt" % steps))
    trainer.save_checkpoint(path, weights_only=False)
    return path, (callbacks[0].guards[0] if guard else None), trainer


def test_lightning_checkpoints_resume_with_and_without_the_callback(tmp_path):
    torch.set_num_threads(1)
    # A run with the guard resumes with it: the guard's counts and detector state go on.
    first, guard, _ = fit(tmp_path, 5)
    assert guard.stats().step_count == 5 and guard.stats().totals.applied == 5
    second, guard, trainer = fit(tmp_path, 7, ckpt_path=first)
    assert guard.stats().step_count == 7 and guard.stats().totals.applied == 7, guard.stats().totals.to_dict()
    assert trainer.optimizers[0].state  # SGD's momentum came back from the checkpoint
    # Its checkpoint resumes without stepguard; a plain run's checkpoint resumes with it.
    fit(tmp_path, 8, guard=False, ckpt_path=second)
    plain, _, _ = fit(tmp_path, 3, guard=False)
    with pytest.warns(RuntimeWarning, match="holds no guard state .* the guard starts fresh"):
        _, guard, trainer = fit(tmp_path, 4, ckpt_path=plain)
    assert guard.stats().step_count == 1 and trainer.global_step == 4


CLIP = 0.05      # below every clean grad norm here: Lightning clips every step
NAN_STEP = 2     # the NaN gradient, in head.weight only


class NanNet(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.body(x)), y)
        if self.global_step == NAN_STEP:
            loss = loss + float("nan") * self.head.weight.sum()
        return loss


class Params(pl.Callback):
    """The parameters after each batch, and Lightning's own grad norm before its clip."""

    def __init__(self, guard_cb=None):
        self.guard_cb = guard_cb
        self.after, self.norms, self.reported = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning.pytorch.utilities import grad_norm
        self.norms.append(float(grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(torch.cat([p.detach().reshape(-1).clone()
                                     for p in pl_module.parameters()]))
        if self.guard_cb is not None:
            self.reported.append(self.guard_cb.guards[0].last_report.grad_norm)


def clipped_fit(root, steps, callbacks):
    params = Params(callbacks[0] if callbacks else None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=CLIP,
                         callbacks=callbacks + [params], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(root))
    trainer.fit(NanNet())
    return params


def test_lightning_refuses_the_guards_own_loss_scaling(tmp_path):
    from stepguard.integrations.lightning import StepguardCallback

    with pytest.raises(Exception, match="leave loss_scaling off"):
        fit_with = StepguardCallback(policy="default", loss_scaling=True)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[fit_with],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(Net())


def test_lightning_a_step_of_the_optimizer_behind_the_guard_is_refused(tmp_path):
    """A step of the wrapped optimizer that does not come through the guard (as a Lightning
    release that stepped it directly would make) is an error, not a silent bypass."""
    from stepguard.integrations.lightning import StepguardCallback

    class Bypass(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.strategy.optimizers[0].optimizer.step()  # the wrapped SGD itself

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2,
                         callbacks=[StepguardCallback(policy="default"), Bypass()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="stepped the wrapped SGD outside the guard"):
        trainer.fit(Net())


class ShardedNet(Net):
    """The same model under Lightning's ModelParallelStrategy: FSDP2's fully_shard on the data-
    parallel mesh, so every parameter and gradient is a DTensor holding this rank's shard."""
    hook_at = SHARDED_HOOK_AT
    grad_fault = False  # (a hook on a parameter fully_shard replaces would never run)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for module in (self.body, self.head):
            fully_shard(module, mesh=mesh)
        fully_shard(self, mesh=mesh)


class ShardRecorder(pl.Callback):
    """After each batch: the guard's outcome and grad norm, the norm of the whole gradient put
    together from the shards (DTensor.full_tensor(), a collective on every rank), and a checksum
    of the whole parameters."""

    def __init__(self, guard_callback):
        self.guard_callback = guard_callback
        self.steps = []
        self.full_norm = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad.full_tensor() for p in pl_module.parameters() if p.grad is not None]
        self.full_norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.double()) for g in grads])))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        report = self.guard_callback.guards[0].last_report
        digest = hashlib.sha256()
        for p in pl_module.parameters():
            digest.update(p.full_tensor().detach().numpy().tobytes())
        self.steps.append({"outcome": report.outcome if report is not None else "dropped",
                           "grad_norm": report.grad_norm if report is not None else None,
                           "full_norm": self.full_norm, "checksum": digest.hexdigest()})
        self.full_norm = None


def train_sharded(out):
    from lightning.pytorch.strategies import ModelParallelStrategy
    from stepguard.integrations.lightning import StepguardCallback

    torch.set_num_threads(1)
    guard_cb = StepguardCallback(policy=str(HERE / "policy.yaml"), collective_timeout=30)
    recorder = ShardRecorder(guard_cb)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=SHARDED_STEPS, max_epochs=1,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                       process_group_backend="gloo",
                                       timeout=timedelta(seconds=60)),
        callbacks=[guard_cb, recorder], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=out)
    model = ShardedNet()
    trainer.fit(model)
    guard = guard_cb.guards[0]
    torch.save({"steps": recorder.steps, "incidents": guard_cb.incidents,
                "totals": guard.stats().totals.to_dict(),
                "finite": all(bool(p.full_tensor().isfinite().all()) for p in model.parameters())},
               os.path.join(out, "rank%d.pt" % trainer.global_rank))


def leave():
    """Ends a rank's script after its results are saved, without interpreter finalization (as
    hf_worker.py does): torch's Gloo worker thread can drop the last reference to a finished
    collective after the main thread began Py_FinalizeEx, and libstdc++ then aborts ("terminate
    called without an active exception", SIGABRT), with or without stepguard. The test reads
    the ranks' files once every rank has closed its output."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    train_sharded(sys.argv[1]) if sys.argv[2:] == ["sharded"] else train(sys.argv[1])
    leave()


def test_lightning_older_than_the_tested_release_is_refused(tmp_path, monkeypatch):
    from stepguard.integrations.lightning import StepguardCallback

    monkeypatch.setattr(pl, "__version__", "2.0.0")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1,
                         callbacks=[StepguardCallback(policy="default")], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"lightning 2\.0\.0 is older than the releases tested "
                                           r"\(2\.6\.6\)"):
        trainer.fit(Net())

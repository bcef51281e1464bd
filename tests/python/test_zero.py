"""Sharded optimizer state (ZeRO-1) and sharded gradients under the guard: real processes
(torch.multiprocessing) over Gloo on loopback, torch's ZeroRedundancyOptimizer around AdamW.

Expectations come from the runs themselves recorded before the fact (the parameters and the local
optimizer's shard after each step), from torch (the unsplit grad norm), and from the policy's
rules; never from the guard's own state."""

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer

import stepguard
from conftest import loss_of, make_model

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LR = 1e-2

# Skip NaN/Inf and halve the LR for good (recover_after 0) from then on; a loss more than 10x its
# running mean after 3 values is a spike: roll back to the newest confirmed snapshot (every 3
# steps) and skip one batch.
POLICY = """version: 1
checkpoint: {snapshot_every: 3, snapshot_keep: 2}
detectors:
  loss_spike: {warmup: 100, early_factor: 10, early_after: 3}
rules:
  - {name: skip-nonfinite, on: nonfinite, action: skip_batch}
  - {name: halve-lr, on: nonfinite, action: lower_lr, factor: 0.5}
  - {name: rollback-on-spike, on: loss_spike, action: rollback, skip_batches: 1}
"""
NAN_STEP, SPIKE_STEP, STEPS = 5, 9, 12


def _init(rank, world, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def _zero(model):
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _shard(zero, model):
    """This rank's optimizer state, by the parameter's index among all of them."""
    index = {p: i for i, p in enumerate(model.parameters())}
    return {index[p]: {k: v.clone() for k, v in st.items()} for p, st in zero.optim.state.items()
            if st}


def _data_parallel_backward(model, batch, rank, world, scale=1.0):
    loss = loss_of(model, batch * world + rank)
    (loss * scale).backward()
    for p in model.parameters():  # what DDP does: average the gradients
        dist.all_reduce(p.grad)
        p.grad /= world
    return loss * scale


def _spy(zero, record):
    """Counts ZeroRedundancyOptimizer.step() calls and records the local optimizer's lrs during
    its step; makes consolidate_state_dict (a collective) fail loudly."""
    outer_step, inner_step = zero.step, zero.optim.step

    def step(*args, **kwargs):
        record["zero_steps"] += 1
        return outer_step(*args, **kwargs)

    def local_step(*args, **kwargs):
        record["inner_lrs"].append([g["lr"] for g in zero.optim.param_groups])
        return inner_step(*args, **kwargs)

    def consolidate(*args, **kwargs):
        raise AssertionError("consolidate_state_dict was called")

    zero.step, zero.optim.step, zero.consolidate_state_dict = step, local_step, consolidate


def _skip_and_rollback_rank(rank, world, init_file, out_dir):
    _init(rank, world, init_file)
    model = make_model(21)
    zero = _zero(model)
    record = {"zero_steps": 0, "inner_lrs": [], "steps": []}
    _spy(zero, record)
    guard = stepguard.GuardedOptimizer(zero, model.named_parameters(), policy_yaml=POLICY,
                                       process_group=dist.group.WORLD, collective_timeout=60)
    batch = 0
    for step in range(1, STEPS + 1):
        guard.zero_grad()
        scale = 1000.0 if step == SPIKE_STEP and rank == 2 else 1.0
        loss = _data_parallel_backward(model, batch, rank, world, scale)
        batch += 1
        if step == NAN_STEP and rank == 1:
            model[0].weight.grad[3, 1] = float("nan")  # rank-local, after the average
        report = guard.step(loss.detach())
        batch += report.batches_to_skip
        record["steps"].append({
            "outcome": report.outcome, "rolled_back_to": report.rolled_back_to,
            "lr_factor": report.lr_factor, "params": _flat(model), "shard": _shard(zero, model),
            "lrs_after": [g["lr"] for g in zero.param_groups]
            + [g["lr"] for g in zero.optim.param_groups],
            "zero_steps": record["zero_steps"],
        })
    record["port_state_names"] = [name for name, _ in guard._port.state_tensors()]
    torch.save(record, os.path.join(out_dir, "rank%d.pt" % rank))
    dist.destroy_process_group()


def _run(fn, world, *args):
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(fn, args=(world, os.path.join(d, "init"), d) + args, nprocs=world,
                           start_method="spawn", join=True)
        return [torch.load(os.path.join(d, "rank%d.pt" % r)) for r in range(world)]


def _same_shard(a, b):
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i]) for i in a)


def test_skip_and_rollback_keep_four_ranks_and_their_shards_consistent():
    world = 4
    ranks = _run(_skip_and_rollback_rank, world)
    expected = (["applied"] * (NAN_STEP - 1) + ["skipped"]
                + ["applied"] * (SPIKE_STEP - NAN_STEP - 1) + ["rolled_back"]
                + ["applied"] * (STEPS - SPIKE_STEP))
    # The state really is sharded: the ranks hold disjoint parts that cover every parameter.
    owned = [set(r["steps"][-1]["shard"]) for r in ranks]
    assert all(owned) and set().union(*owned) == {0, 1, 2, 3}
    assert sum(len(o) for o in owned) == 4
    for r, o in zip(ranks, owned):
        assert {int(n.split(".")[0]) for n in r["port_state_names"]} == o
    for rank, r in enumerate(ranks):
        steps = r["steps"]
        assert [s["outcome"] for s in steps] == expected, rank
        # ZeroRedundancyOptimizer.step() ran exactly on the applied steps (none on a skip or a
        # rollback: no rank broadcast alone).
        assert [s["zero_steps"] for s in steps] == [
            sum(o == "applied" for o in expected[:i + 1]) for i in range(STEPS)]
        # A skip changes nothing: parameters and the shard as after the step before.
        before, skipped = steps[NAN_STEP - 2], steps[NAN_STEP - 1]
        assert torch.equal(skipped["params"], before["params"])
        assert _same_shard(skipped["shard"], before["shard"])
        # The rollback restores the snapshot of step 6 (taken after step 6, confirmed by the
        # clean steps 7 and 8): all parameters and this rank's own shard, bitwise.
        rolled = steps[SPIKE_STEP - 1]
        assert rolled["rolled_back_to"] == 6
        assert torch.equal(rolled["params"], steps[5]["params"])
        assert _same_shard(rolled["shard"], steps[5]["shard"])
        assert not _same_shard(rolled["shard"], steps[SPIKE_STEP - 2]["shard"])
        # The LR factor 0.5 from the NaN step on reached the local optimizer during each step
        # and left both sets of param groups after it.
        assert [s["lr_factor"] for s in steps] == [1.0] * (NAN_STEP - 1) + [0.5] * (
            STEPS - NAN_STEP + 1)
        assert r["inner_lrs"] == [[LR]] * (NAN_STEP - 1) + [[LR * 0.5]] * (
            len(r["inner_lrs"]) - NAN_STEP + 1)
        assert all(s["lrs_after"] == [LR, LR] for s in steps)
    # Every rank ends every step with the same parameters.
    for i in range(STEPS):
        for r in ranks[1:]:
            assert torch.equal(r["steps"][i]["params"], ranks[0]["steps"][i]["params"]), i


def _checkpoint_rank(rank, world, init_file, out_dir, ckpt_dir, phase):
    _init(rank, world, init_file)
    model = make_model(31 if phase == "train" else 32)  # resume must bring the weights back
    zero = _zero(model)
    guard = stepguard.GuardedOptimizer(zero, model.named_parameters(),
                                       process_group=dist.group.WORLD, collective_timeout=60,
                                       checkpoint_dir=ckpt_dir, checkpoint_every=3,
                                       run_id="zero-test")
    out = {"refused": _refused_setups(model)} if phase == "train" else {}
    first = 1
    if phase == "resume":
        first = guard.resume(ckpt_dir) + 1
        out["resumed_at"] = first - 1
        out["params_resumed"], out["shard_resumed"] = _flat(model), _shard(zero, model)
    for step in range(first, 8):
        guard.zero_grad()
        loss = _data_parallel_backward(model, guard.stats().data_position, rank, world)
        assert guard.step(loss.detach()).applied
        guard.wait_for_background_work()  # this rank's checkpoint write is done before the next step
        if step == 6:
            out["params_6"], out["shard_6"] = _flat(model), _shard(zero, model)
    out["params_7"] = _flat(model)
    guard.commit_pending_checkpoint()
    if phase == "resume":
        # One rank alone (a world of 1, its own group) must refuse the 2-rank checkpoint.
        groups = [dist.new_group([r]) for r in range(world)]
        alone = make_model(33)
        lone = stepguard.GuardedOptimizer(
            ZeroRedundancyOptimizer(alone.parameters(), optimizer_class=torch.optim.AdamW,
                                    process_group=groups[rank], lr=LR),
            alone.named_parameters(), process_group=groups[rank])
        out["refusal"] = _resume_error(lone, ckpt_dir)
        out["alone_untouched"] = torch.equal(_flat(alone), _flat(make_model(33)))
        plain = stepguard.GuardedOptimizer(torch.optim.AdamW(alone.parameters(), lr=LR),
                                           process_group=groups[rank])
        out["plain_refusal"] = _resume_error(plain, ckpt_dir)
    torch.save(out, os.path.join(out_dir, "rank%d.pt" % rank))
    dist.destroy_process_group()


def _resume_error(guard, ckpt_dir):
    try:
        guard.resume(ckpt_dir)
        return None
    except stepguard.StepguardError as e:
        return str(e)


def _refused_setups(model):
    """The messages of the setups the guard refuses around a ZeroRedundancyOptimizer."""
    out = []
    for build in (lambda: stepguard.GuardedOptimizer(_zero(model)),  # no process_group
                  lambda: stepguard.GuardedOptimizer(
                      ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                              overlap_with_ddp=True, lr=LR),
                      process_group=dist.group.WORLD)):
        try:
            build()
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_disk_checkpoint_holds_each_ranks_shard_and_resumes_on_two_ranks_only():
    world = 2
    with tempfile.TemporaryDirectory() as ckpt:
        trained = _run(_checkpoint_rank, world, ckpt, "train")
        resumed = _run(_checkpoint_rank, world, ckpt, "resume")
        with open(os.path.join(ckpt, "step-000000006", "MANIFEST.json")) as f:
            assert json.load(f)["world_size"] == 2
    assert trained[0]["shard_6"].keys().isdisjoint(trained[1]["shard_6"].keys())
    for rank in range(world):
        t, r = trained[rank], resumed[rank]
        assert r["resumed_at"] == 6
        assert torch.equal(r["params_resumed"], t["params_6"])
        assert _same_shard(r["shard_resumed"], t["shard_6"])  # this rank's own shard
        assert torch.equal(r["params_7"], t["params_7"])  # and the run goes on as it would have
        assert r["refusal"] is not None, rank
        assert "step-000000006: it was saved by 2 ranks and this run has 1" in r["refusal"]
        assert "the optimizer state is sharded across the ranks" in r["refusal"]
        assert "Resume with 2 ranks." in r["refusal"]
        assert r["alone_untouched"]
        assert "saved by 2 ranks and this run has 1; each rank resumes from its own rank file" \
            in r["plain_refusal"]
        no_group, overlap = t["refused"]
        assert "shards its state over 2 ranks; give the guard process_group=" in no_group
        assert "overlap_with_ddp=True" in overlap
    assert torch.equal(trained[0]["params_7"], trained[1]["params_7"])


def _split_gradients_rank(rank, world, init_file, out_dir):
    _init(rank, world, init_file)
    model = make_model(41)
    loss = loss_of(model, 0)  # the same batch everywhere: every rank computes the full gradient
    loss.backward()
    full = [p.grad.detach().clone() for p in model.parameters()]
    for i, p in enumerate(model.parameters()):
        if i % world != rank:  # not this rank's: rank 0 drops it, the others zero it
            if rank == 0:
                p.grad = None
            else:
                p.grad.zero_()
    norms = {}
    for sharded in (True, False):
        guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                           model.named_parameters(), sharded_gradients=sharded,
                                           process_group=dist.group.WORLD, collective_timeout=60,
                                           zero_grad_on_skip=False)
        norms[sharded] = guard.step(loss.detach()).grad_norm
    local = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
                if p.grad is not None)
    torch.save({"full": full, "norms": norms, "local": local},
               os.path.join(out_dir, "rank%d.pt" % rank))
    dist.destroy_process_group()


def test_sharded_gradients_sum_the_ranks_parts_into_the_unsplit_norm():
    world = 2
    ranks = _run(_split_gradients_rank, world)
    full = ranks[0]["full"]
    expected = torch.sqrt(sum(g.double().pow(2).sum() for g in full)).item()
    total = expected ** 2
    for r in ranks:
        assert 0.0 < r["local"] < total  # each rank really holds only a part
        assert abs(r["norms"][True] - expected) <= 1e-9 * expected
        # Read as replicated gradients, the same parts give the mean of the parts instead.
        assert abs(r["norms"][False] - (total / world) ** 0.5) <= 1e-9 * expected
    assert abs(sum(r["local"] for r in ranks) - total) <= 1e-9 * total


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_train_gpt_with_zero_under_torchrun_with_two_ranks():
    with tempfile.TemporaryDirectory() as d:
        summary_path = os.path.join(d, "summary.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # As test_distributed.py runs it (see there for --redirects); the agent polls its
        # workers every 0.2 s instead of 5.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--redirects", "2", "--tee", "2",
               "--monitor_interval", "0.2", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               os.path.join(ROOT, "integration", "pytorch", "train_gpt.py"),
               "--optimizer", "zero", "--steps", "12", "--batch-size", "4", "--context", "32",
               "--inject", "nan_grad@6:1", "--summary-json", summary_path]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        with open(summary_path) as f:
            s = json.load(f)
    assert s["ranks"] == 2 and s["steps"] == 12 and s["optimizer"] == "zero"
    assert s["skipped"] == 1 and s["applied"] == 11 and s["rollbacks"] == 0
    assert [(i["step"], i["ranks"]) for i in s["incidents"]] == [(6, [1])]  # rank 1's alone
    assert len(set(s["param_hashes"])) == 1 and s["params_finite"]
    assert s["final_loss"] < s["initial_loss"]  # it learns

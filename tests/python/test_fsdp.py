"""FSDP2 (torch.distributed.fsdp.fully_shard) under the guard: DTensor parameters, gradients and
optimizer state, each rank holding its shard, real processes over Gloo on loopback at 2 and 4
ranks. The guard reads and restores each rank's local shard; sharded_gradients=True adds the
ranks' sums of squares.

Expectations come from torch (clip_grad_norm_ on the same model, before the step), from the runs
recorded before the fact (each rank's shards after every step), and from the policy's rules."""

import datetime
import logging
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import stepguard

POLICY = """version: 1
checkpoint: {snapshot_every: 1, snapshot_keep: 3}
rules:
  - {name: rollback-on-nan-loss, on: nonfinite_loss, action: rollback, skip_batches: 1}
  - {name: skip-nonfinite, on: nonfinite_grad, action: skip_batch}
"""
NAN_GRAD_STEP, NAN_LOSS_STEP, STEPS = 3, 6, 8


def _model(world):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _shards(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def _state_shards(optimizer, model):
    out = []
    for p in model.parameters():
        st = optimizer.state.get(p, {})
        out.append({k: (v.to_local() if isinstance(v, DTensor) else v).clone()
                    for k, v in st.items()})
    return out


def _fsdp_rank(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    model = _model(world)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = stepguard.GuardedOptimizer(adamw, model.named_parameters(), policy_yaml=POLICY,
                                       process_group=dist.group.WORLD, sharded_gradients=True,
                                       collective_timeout=60)
    record = {"steps": [], "after": {0: (_shards(model), _state_shards(adamw, model))},
              "log": []}
    logged = logging.Handler(logging.DEBUG)  # the incident lines the job prints (rank 0's)
    logged.emit = lambda r: record["log"].append(r.getMessage())
    logging.getLogger("stepguard").addHandler(logged)
    logging.getLogger("stepguard").setLevel(logging.DEBUG)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        guard.zero_grad()
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        torch_norm = torch_norm.full_tensor().item()
        if step == NAN_GRAD_STEP and rank == world - 1:
            model[2].weight.grad.to_local()[0, 0] = float("nan")  # this rank's shard only
        if step == NAN_LOSS_STEP and rank == 0:
            loss = loss * float("nan")
        before = _shards(model)
        report = guard.step(loss)
        record["steps"].append({
            "step": report.step, "outcome": report.outcome, "grad_norm": report.grad_norm,
            "torch_norm": torch_norm, "rolled_back_to": report.rolled_back_to,
            "incident": report.incident, "unchanged": all(
                torch.equal(a, b) for a, b in zip(before, _shards(model)))})
        record["after"][step] = (_shards(model), _state_shards(adamw, model))
    torch.save(record, os.path.join(out_dir, "rank%d.pt" % rank))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_nan_on_one_shard_is_skipped_everywhere_and_a_rollback_restores_every_shard(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_fsdp_rank, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world)
        records = [torch.load(os.path.join(tmp, "rank%d.pt" % r), weights_only=False)
                   for r in range(world)]
    for rank, rec in enumerate(records):
        steps = rec["steps"]
        outcomes = [s["outcome"] for s in steps]
        assert outcomes == ["applied", "applied", "skipped", "applied", "applied", "rolled_back",
                            "applied", "applied"], (rank, outcomes)
        nan_step = steps[NAN_GRAD_STEP - 1]
        assert nan_step["unchanged"]
        assert nan_step["incident"]["tensors"] == ["2.weight"]
        # The NaN was written into the last rank's shard after the reduce-scatter, and FSDP2's
        # gradients get no hook before it: a shard holds what every rank sent, so the origin is
        # unknown (before: the shard's rank was named) and the evidence names the shard's rank.
        assert nan_step["incident"]["ranks"] == [] and nan_step["incident"]["origin_unknown"], (
            nan_step["incident"])
        assert any(e.startswith("which rank made the NaN/Inf is not known")
                   and e.endswith("on rank %d" % (world - 1))
                   for e in nan_step["incident"]["evidence"]), nan_step["incident"]
        assert ("step 3: nonfinite_grad -> skip_batch (cause backward; tensors 2.weight; ranks "
                "unknown)") in rec["log"], rec["log"]
        for s in steps:
            if s["step"] not in (NAN_GRAD_STEP, NAN_LOSS_STEP):
                assert s["grad_norm"] == pytest.approx(s["torch_norm"], rel=1e-6), (rank, s)
        # The rollback restores this rank's shards and optimizer state of the snapshot bitwise.
        back = steps[NAN_LOSS_STEP - 1]
        assert back["incident"]["ranks"] == [0] and back["rolled_back_to"] >= 1
        assert not back["incident"]["origin_unknown"]  # rank 0's own NaN loss names it
        params, state = rec["after"][NAN_LOSS_STEP]
        want_params, want_state = rec["after"][back["rolled_back_to"]]
        assert all(torch.equal(a, b) for a, b in zip(params, want_params))
        for got, want in zip(state, want_state):
            assert set(got) == set(want)
            assert all(torch.equal(got[k], want[k]) for k in got)
        # Training goes on from there: the next steps change the shards again.
        assert not all(torch.equal(a, b) for a, b in zip(rec["after"][STEPS][0], params))


def test_dtensor_gradients_need_sharded_gradients():
    """FSDP2's gradients are shards: without sharded_gradients=True the norm would be wrong."""
    if not dist.is_available():
        pytest.skip("torch without distributed")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "init"),
                                rank=0, world_size=1)
        try:
            model = _model(1)
            with pytest.raises(ValueError, match="sharded_gradients=True"):
                stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters()),
                                           model.named_parameters(),
                                           process_group=dist.group.WORLD)
        finally:
            dist.destroy_process_group()

"""The optimizer state under the real DeepSpeed ZeRO 2 (fp32, 2 ranks over Gloo, CPU): a NaN in
rank 1's shard of AdamW's exp_avg_sq is caught before its update, named on rank 1 and rolled back
(the default policy's optimizer state check); the reset_moments action (SPAM) zeroes each rank's
flat partition of the moments after a skipped step and keeps the step counter."""

import json
import os

import torch
import torch.nn as nn

os.environ["DS_ACCELERATOR"] = "cpu"
import deepspeed  # noqa: E402  (a missing DeepSpeed fails the test)

import stepguard.integrations.deepspeed as sg_deepspeed  # noqa: E402
from conftest import spawn_ranks  # noqa: E402
from test_deepspeed import MICRO, _batch, _flat_params, _model  # noqa: E402


def _replicas(engine, world):
    """Whether this rank's parameters are finite, and equal on every rank (one all-gather)."""
    flat = _flat_params(engine.module)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    return bool(torch.isfinite(flat).all()), all(torch.equal(flat, t) for t in gathered)


def _finish(rows, rank, out_dir):
    """Writes this rank's rows for the test (spawn_ranks then leaves the process)."""
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(rows, f, default=str)
    torch.distributed.destroy_process_group()


def _zero_two_engine(rank, world, port):
    """This rank's DeepSpeed engine: ZeRO 2, fp32, torch's AdamW, MICRO micro-batches a step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": MICRO,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 6}
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=model.parameters())
    return engine


def _corrupt_state_main(rank, world, port, out_dir):
    """ZeRO 2 fp32 under the default policy (snapshots every 5 steps): after step 7, one element
    of rank 1's shard of AdamW's exp_avg_sq is set to NaN (each rank holds and checks its own
    shard of the state)."""
    import stepguard
    engine = _zero_two_engine(rank, world, port)
    policy = stepguard.policy_presets()["default"].replace("snapshot_every: 50",
                                                           "snapshot_every: 5")
    guarded = sg_deepspeed.guard_engine(engine, policy_yaml=policy, collective_timeout=60)
    rows = []
    for step in range(1, 13):
        for micro in range(MICRO):
            x, y = _batch(step * MICRO + micro, rank, torch.float32)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        report = guarded.last_report
        finite, equal = _replicas(engine, world)
        rows.append({"step": report.step, "outcome": report.outcome, "incident": report.incident,
                     "finite": finite, "equal": equal})
        if step == 7 and rank == 1:
            state = next(iter(engine.basic_optimizer.state.values()))
            with torch.no_grad():
                state["exp_avg_sq"].view(-1)[3] = float("nan")
    _finish(rows, rank, out_dir)


def test_a_corrupted_state_shard_under_zero_two_is_named_on_its_rank_and_rolled_back():
    for rank, rows in enumerate(spawn_ranks(_corrupt_state_main, 2)):
        assert all(r["finite"] and r["equal"] for r in rows), rows
        hits = [r for r in rows if r["incident"]]
        assert [r["step"] for r in hits] == [8], [(r["step"], r["incident"]) for r in hits]
        incident = hits[0]["incident"]
        assert hits[0]["outcome"] == "rolled_back" and "(rolled back to step 5)" in \
            incident["reason"], incident
        assert incident["signal"] == "optimizer_state", incident
        assert incident["cause"] == "optimizer_state" and incident["ranks"] == [1], incident
        assert "on rank 1" in " ".join(incident["evidence"]), incident
        # The state DeepSpeed keeps per param group: its flat fp32 partition on this rank.
        assert incident["tensors"] == ["exp_avg_sq of group0.tensor0"], incident


RESET_POLICY = """version: 1
rules:
  - {on: nonfinite, action: skip_batch}
  - {on: nonfinite, action: reset_moments}
"""


def _reset_moments_main(rank, world, port, out_dir):
    """ZeRO 2 fp32 on 2 ranks, a policy that skips a non-finite step and resets the optimizer's
    moments (SPAM): rank 1's loss is NaN in step 6's first micro-batch."""
    engine = _zero_two_engine(rank, world, port)
    guarded = sg_deepspeed.guard_engine(engine, policy_yaml=RESET_POLICY, collective_timeout=60)
    rows = []
    for step in range(1, 10):
        for micro in range(MICRO):
            x, y = _batch(step * MICRO + micro, rank, torch.float32)
            loss = nn.functional.mse_loss(engine(x), y)
            if step == 6 and rank == 1 and micro == 0:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
        report = guarded.last_report
        state = next(iter(engine.basic_optimizer.state.values()))  # this rank's flat partition
        finite, equal = _replicas(engine, world)
        rows.append({"step": report.step, "outcome": report.outcome,
                     "actions": [str(a).split(".")[-1].lower() for a in report.actions],
                     "moments": [float(state[k].abs().sum()) for k in ("exp_avg", "exp_avg_sq")],
                     "state_step": float(state["step"]),
                     "finite": finite, "equal": equal})
    _finish(rows, rank, out_dir)


def test_reset_moments_under_zero_two_zeroes_every_ranks_partition_and_keeps_the_step():
    """SPAM's reset through DeepSpeed's flat partitions: the blamed gradients are model
    parameters, the state is kept per flat partition, so each rank's whole partition of exp_avg
    and exp_avg_sq is zeroed after the skipped step; the step counter stays; training goes on
    with the replicas equal."""
    for rank, rows in enumerate(spawn_ranks(_reset_moments_main, 2)):
        assert all(r["finite"] and r["equal"] for r in rows), (rank, rows)
        assert [r["outcome"] for r in rows] == ["applied"] * 5 + ["skipped"] + ["applied"] * 3
        assert rows[5]["actions"] == ["skip_batch", "reset_moments"], rows[5]
        assert all(m > 0 for r in rows[:5] for m in r["moments"]), rows
        assert rows[5]["moments"] == [0.0, 0.0], (rank, rows[5])
        assert rows[4]["state_step"] == rows[5]["state_step"] == 5.0, rows
        assert rows[6]["state_step"] == 6.0 and all(m > 0 for m in rows[6]["moments"]), rows


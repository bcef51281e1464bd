"""The slow faults a spike test cannot see, against the default policy, with the decoder of
test_fault_matrix.py under DDP on 2 Gloo ranks (real processes over loopback):

- smooth divergence: the output head's weights grow 2% a step from step 150 (as a missing weight
  decay on a growing layer would): the loss rises with no spike; `loss_trend` is raised (cause
  divergence, "the loss has been rising for ... steps") and the LR is halved. Before, nothing
  fired in 450 steps.
- a schedule that sets the LR to 0 from step 60: `stall` after 20 such steps (an alert naming
  the learning rate), again 20 steps later; a loss cut off from the model (every gradient
  exactly 0): `stall` naming the grad norm.
- 3% of rank 1's labels shuffled for 20 steps (its loss 2-8x rank 0's, no spike):
  `rank_loss_shift` from the third step of each run of shifted steps, each skipped, naming rank 1
  with cause data. Before, nothing fired (the mean loss stayed inside its scatter).
- one element of AdamW's exp_avg_sq on rank 1 set to NaN, or to -1 (a bit flip, a corrupted
  resume): `optimizer_state` at the very next step, before its update, naming rank 1, the state
  tensor and cause optimizer_state; the default policy rolls back to the last snapshot and no
  weight is ever NaN. Before, the update wrote NaN into the weights, the next step read "cause
  forward" and the replica check rolled back one step later still.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from test_fault_matrix import VOCAB, batch, ddp, guard_for, incident_row, spawn_scenarios


def train(guard, model, steps, opt=None, lr_at=None, after_step=None, labels=None,
          cut_off=None):
    """Trains `steps` steps; one row per step with the report's figures and incident."""
    rank = dist.get_rank()
    rows = []
    position = 0  # the data position: a rollback's batches_to_skip are dropped, as a loop does
    for step in range(1, steps + 1):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        position += 1
        x, y = batch(position, rank)
        if labels is not None:
            y = labels(position, rank, y)
        guard.zero_grad()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        if cut_off is not None and cut_off(step):
            # A loss the model's parameters no longer reach (a detached graph): zero gradients.
            loss = loss.detach() + 0.0 * logits.sum()
        loss.backward()
        report = guard.step(loss.detach())
        position += report.batches_to_skip
        rows.append({"step": step, "outcome": str(report.outcome).split(".")[-1],
                     "loss": report.loss, "lr_factor": report.lr_factor,
                     "incident": incident_row(report)})
        if after_step is not None:
            after_step(step)
    return rows


def scenario_smooth_divergence():
    model = ddp(11)
    _, guard = guard_for(model, 3e-3)
    head = model.module.head

    def grow(step):
        if step >= 150:
            with torch.no_grad():
                head.weight.mul_(1.02)
                head.bias.mul_(1.02)
    return train(guard, model, 450, after_step=grow)


def scenario_lr_zero():
    model = ddp(12)
    opt, guard = guard_for(model, 3e-3)
    return train(guard, model, 100, opt=opt, lr_at=lambda step: 3e-3 if step < 60 else 0.0)


def scenario_cut_off():
    model = ddp(13)
    _, guard = guard_for(model, 3e-3)
    return train(guard, model, 90, cut_off=lambda step: step >= 60)


def scenario_shuffled_labels():
    model = ddp(14)
    _, guard = guard_for(model, 3e-3)

    def labels(position, rank, y):
        if rank == 1 and 120 <= position < 140:
            # 3% of the labels shuffled: this rank's loss 2-8x the other's, no spike.
            g = torch.Generator().manual_seed(position)
            y = y.clone()
            pick = torch.rand(y.shape, generator=g) < 0.03
            y[pick] = torch.randint(0, VOCAB, (int(pick.sum()),), generator=g)
        return y
    return train(guard, model, 160, labels=labels)


def scenario_corrupt_state(value):
    model = ddp(15)
    opt, guard = guard_for(model, 3e-3)
    head = model.module.head
    rank = dist.get_rank()
    finite = []

    def corrupt(step):
        finite.append(all(bool(torch.isfinite(p).all()) for p in model.parameters()))
        if step == 70 and rank == 1:
            with torch.no_grad():
                opt.state[head.weight]["exp_avg_sq"].view(-1)[5] = value
    rows = train(guard, model, 90, after_step=corrupt)
    for row, ok in zip(rows, finite):
        row["weights_finite"] = ok
    return rows


def rank_main(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    out = {"divergence": scenario_smooth_divergence(), "lr_zero": scenario_lr_zero(),
           "cut_off": scenario_cut_off(), "shuffled": scenario_shuffled_labels(),
           "state_nan": scenario_corrupt_state(float("nan")),
           "state_negative": scenario_corrupt_state(-1.0)}
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def matrix():
    return spawn_scenarios(rank_main)


def raised(rows, signal):
    return [r for r in rows if r["incident"] and r["incident"]["signal"] == signal]


def test_smooth_divergence_is_a_loss_trend_and_lowers_the_lr(matrix):
    for out in matrix:
        rows = out["divergence"]
        assert not [r for r in rows[:150] if r["incident"]], rows[:150]
        hits = raised(rows, "loss_trend")
        assert hits, [(r["step"], r["loss"]) for r in rows[::25]]
        first = hits[0]
        # Seen while the loss is still below an untrained model's, long before it runs away.
        assert 250 < first["step"] < 450 and first["loss"] < rows[0]["loss"], first
        incident = first["incident"]
        assert incident["signal"] == "loss_trend" and incident["cause"] == "divergence", incident
        assert "the loss has been rising for" in " ".join(incident["evidence"]), incident
        assert first["lr_factor"] == 0.5 and first["outcome"] == "applied", first
        # Again only at each further 1.3x rise (the growth goes on: the LR cut cannot stop it).
        steps = [r["step"] for r in hits]
        assert len(hits) <= 6 and all(b - a >= 20 for a, b in zip(steps, steps[1:])), steps


def test_an_lr_of_zero_is_a_stall_told_to_on_call(matrix):
    for out in matrix:
        rows = out["lr_zero"]
        hits = raised(rows, "stall")
        assert [r["step"] for r in hits] == [79, 99], [r["step"] for r in hits]
        incident = hits[0]["incident"]
        assert incident["signal"] == "stall", incident
        assert "the learning rate is 0" in " ".join(incident["evidence"]), incident
        assert all(r["outcome"] == "applied" for r in rows), "an alert changes nothing"
        assert not [r for r in rows if r["incident"] and r not in hits]


def test_a_loss_cut_off_from_the_model_is_a_stall_naming_the_grad_norm(matrix):
    for out in matrix:
        hits = raised(out["cut_off"], "stall")
        assert [r["step"] for r in hits] == [79], [r["step"] for r in hits]
        assert "grad norm is exactly 0" in " ".join(hits[0]["incident"]["evidence"])


def test_one_rank_with_shuffled_labels_is_a_rank_loss_shift_skipped_and_named(matrix):
    for rank, out in enumerate(matrix):
        rows = out["shuffled"]
        # Before the shuffled batches and after them (but for the 2 steps the window of 5 still
        # holds them): nothing.
        assert not [r for r in rows if r["incident"] and not 120 <= r["step"] < 142], rows
        hits = raised(rows, "rank_loss_shift")
        # Each run of 3 or more shifted steps (rank 1's loss 2-8x rank 0's, beyond the 0.5-1.8x
        # of clean steps), from its third step on.
        assert len(hits) >= 6 and hits[0]["step"] >= 122, [r["step"] for r in hits]
        for r in hits:
            assert r["outcome"] == "skipped", r
            incident = r["incident"]
            assert incident["ranks"] == [1] and incident["cause"] == "data", incident
        evidence = " ".join(hits[0]["incident"]["evidence"])
        if rank == 1:
            assert "one rank's loss has stood apart" in evidence and "(rank 1)" in evidence, \
                evidence
        else:
            assert "rank 1" in evidence, evidence


def test_the_learning_rate_is_read_only_while_a_detector_uses_it():
    """The stall detector reads the optimizer's largest LR through the port each step; a policy
    without it makes no such call (for a Python port, a call into Python per step)."""
    import stepguard
    from stepguard._port import TorchOptimPort
    from conftest import loss_of, make_model

    class Counting(TorchOptimPort):
        calls = 0

        def largest_lr(self):
            Counting.calls += 1
            return super().largest_lr()

    for policy, expected in (("default", 3), ("version: 1\n", 0)):
        model = make_model(2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        Counting.calls = 0
        kwargs = {"policy": policy} if policy == "default" else {"policy_yaml": policy}
        guard = stepguard.GuardedOptimizer(
            optimizer, port=Counting(optimizer, model.named_parameters()), **kwargs)
        for step in range(3):
            guard.zero_grad()
            loss = loss_of(model, step)
            loss.backward()
            guard.step(loss)
        assert Counting.calls == expected, (policy, Counting.calls)


@pytest.mark.parametrize("case", ["state_nan", "state_negative"])
def test_a_corrupted_optimizer_state_is_caught_before_its_update_and_rolled_back(matrix, case):
    for rank, out in enumerate(matrix):
        rows = out[case]
        assert all(r["weights_finite"] for r in rows), "a weight went NaN"
        hits = [r for r in rows if r["incident"]]
        # The step after the corruption, and nothing else: the rollback restored a good state.
        assert [r["step"] for r in hits] == [71], [(r["step"], r["incident"]) for r in hits]
        row = hits[0]
        assert row["outcome"] == "rolled_back", row
        incident = row["incident"]
        assert incident["signal"] == "optimizer_state", incident
        assert incident["cause"] == "optimizer_state" and incident["ranks"] == [1], incident
        evidence = " ".join(incident["evidence"])
        assert "the optimizer state holds 1 NaN/Inf or negative second-moment element on rank 1" \
            in evidence, evidence
        # Each rank's incident names the state tensor, though only rank 1's held it.
        assert "exp_avg_sq of head.weight" in evidence, evidence
        assert "rolled back to step 50" in incident["reason"], incident


"""The integration layer's shared owners (stepguard/integrations/_core.py), on real tensors and a
real guard: the host-side clip is torch's clip to the last bit and makes no tensor, the step's
loss has one documented reduction, and the batches a rollback drops follow one rule."""

import logging
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import stepguard
from stepguard.integrations._core import (DRAWN, LOOP, OUT_OF_REACH, RUN_NOT_STEPPED,
                                          DroppedBatches, StepLoss, clip_to)
from conftest import loss_of, make_model

ROLLBACK_POLICY = """version: 1
checkpoint: {snapshot_every: 1, snapshot_keep: 2}
rules:
  - {on: nonfinite_loss, action: rollback, skip_batches: 3}
"""


class _Ops(TorchDispatchMode):
    """The ATen ops that run, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _grads(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape in ((7, 3), (5,), (2, 2, 2))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_clip_from_a_host_norm_is_torchs_clip_to_the_last_bit(dtype):
    rng = random.Random(7)
    cases = [(1.0, 0.5), (1.0, 1.0), (1.0, 1.0 - 1e-7), (1.0, 1.0 + 1e-6), (0.3, 1e30),
             (5.0, 1e-12)]
    cases += [(10 ** rng.uniform(-3, 3), 10 ** rng.uniform(-6, 6)) for _ in range(300)]
    for i, (max_norm, norm) in enumerate(cases):
        mine, theirs = _grads(dtype, i), _grads(dtype, i)
        params = []
        for grad in theirs:
            p = torch.nn.Parameter(torch.zeros_like(grad))
            p.grad = grad
            params.append(p)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm))
        clip_to(mine, max_norm, norm)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (dtype, max_norm, norm)


def test_clip_from_a_host_norm_makes_no_tensor():
    grads = _grads(torch.float32, 0) + _grads(torch.bfloat16, 1)
    with _Ops() as ops:
        clip_to(grads, 1.0, 50.0)  # binding: by a host scalar, fp32 in one foreach multiply
    # (a Python number given to mul_ reaches it as a wrapped host scalar: no copy to a device)
    assert ops.names == ["aten._foreach_mul_.Scalar"] + ["aten.mul_.Tensor"] * 3, ops.names
    with _Ops() as ops:
        clip_to(grads, 1.0, 0.5)  # not binding: nothing at all
    assert ops.names == []


def test_the_steps_loss_is_the_mean_of_its_micro_batches_however_they_are_handed():
    losses = [torch.tensor(2.0), torch.tensor(4.0), torch.tensor(9.0)]
    mean = StepLoss("mean")  # each micro-batch's own loss (DeepSpeed's engine.backward)
    divided = StepLoss("sum")  # each divided by the micro-batch count (the Trainers, Megatron)
    for loss in losses:
        mean.add(loss)
        divided.add(loss / len(losses))
    assert mean.take().item() == pytest.approx(5.0) and divided.take().item() == pytest.approx(5.0)
    assert mean.take() is None and not divided  # handed over once; the next step starts empty
    # torchtitan: each micro-batch's loss summed over its tokens, divided by the step's tokens
    # over every rank (here 10); the step's loss is this rank's mean per token.
    tokens = StepLoss("tokens")
    tokens.add(torch.tensor(6.0) / 10, tokens=torch.tensor(3), total=torch.tensor(10))
    tokens.add(torch.tensor(2.0) / 10, tokens=torch.tensor(1), total=torch.tensor(10))
    assert tokens.take().item() == pytest.approx(8.0 / 4)
    with pytest.raises(ValueError, match="'median' is not one of mean, sum, tokens"):
        StepLoss("median")


def _rollback_report():
    """A real guard's report of a rollback that drops 3 batches."""
    model = make_model(4)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       model.named_parameters(), policy_yaml=ROLLBACK_POLICY)
    for step in (1, 2, 3):
        guard.zero_grad()
        loss = loss_of(model, step) * (float("nan") if step == 3 else 1.0)
        loss.backward()
        report = guard.step(loss)
    assert report.rolled_back and report.batches_to_skip == 3
    return report


def test_the_batches_a_rollback_drops_follow_one_rule(caplog):
    report = _rollback_report()
    caplog.set_level(logging.INFO, logger="stepguard")
    caplog.clear()  # (the guard's own incident line)
    drawn = DroppedBatches("torchtitan", DRAWN)
    drawn.note(report)
    data = iter(range(100))
    assert drawn.draw(data, per_batch=2) == 3 and next(data) == 6  # 3 batches of 2 items
    assert drawn.draw(data, per_batch=2) == 0 and drawn.dropped == 3
    run = DroppedBatches("Lightning", RUN_NOT_STEPPED)
    run.note(report)
    assert [run.take() for _ in range(4)] == [True, True, True, False] and run.dropped == 3
    assert caplog.records == []  # where the guard drops them itself it says nothing more
    loop = DroppedBatches("DeepSpeed", LOOP)
    loop.note(report)
    loop.note(report)
    assert loop.pending == 6
    reach = DroppedBatches("the HF Trainer", OUT_OF_REACH)
    reach.note(report)
    reach.note(report)
    assert reach.pending == 0  # nothing to drop later: they are trained on
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("INFO", "stepguard: the policy's rollback drops the next 3 batch(es); under DeepSpeed "
                 "the training loop owns the data iterator: draw them with "
                 "drop_batches(iterator) before the next step (or skip report.batches_to_skip); "
                 "said once per run"),
        ("WARNING", "stepguard: the policy's rollback asks to drop the next 3 batch(es); under "
                    "the HF Trainer the data order is out of the guard's reach, so they are "
                    "trained on (said once per run)")], said

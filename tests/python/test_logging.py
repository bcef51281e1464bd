"""The `stepguard` logger: one WARNING line per incident, INFO for a rollback's data skip and for
resume, nothing for a clean step (standard logging: caplog reads what a handler would get)."""

import logging

import torch

import stepguard
from conftest import loss_of, make_model

POLICY = """version: 1
checkpoint: {snapshot_every: 1, snapshot_keep: 2}
rules:
  - {on: nonfinite_loss, action: rollback, skip_batches: 2}
  - {on: nonfinite_grad, action: skip_batch}
"""


def _step(guard, model, step, fault=None):
    guard.zero_grad()
    loss = loss_of(model, step)
    if fault == "nan_loss":
        loss = loss * float("nan")
    loss.backward()
    if fault == "nan_grad":
        next(model.parameters()).grad.view(-1)[0] = float("nan")
    return guard.step(loss)


def test_clean_steps_log_nothing_and_each_incident_one_warning(caplog):
    model = make_model(11)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), policy_yaml=POLICY)
    name = next(iter(dict(model.named_parameters())))
    with caplog.at_level(logging.DEBUG, logger="stepguard"):
        for step in (1, 2, 3):
            assert _step(guard, model, step).applied
        assert [r for r in caplog.records if r.name == "stepguard"] == []
        assert _step(guard, model, 4, "nan_grad").skipped
        assert _step(guard, model, 5, "nan_loss").rolled_back
    records = [r for r in caplog.records if r.name == "stepguard"]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("WARNING", "step 4: nonfinite_grad -> skip_batch (cause backward; tensors %s; "
                    "ranks 0)" % name),
        ("WARNING", "step 5: nonfinite_loss -> rollback (cause forward; tensors 2.bias,2.weight,"
                    "0.bias,0.weight; ranks 0)"),
        # Step 3's snapshot was never confirmed (step 4 was skipped): back to step 2's.
        ("INFO", "step 5: rolled back to step 2; the policy asks to drop the next 2 batches"),
    ]


def test_resume_is_logged_at_info(tmp_path, caplog):
    model = make_model(12)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    with caplog.at_level(logging.INFO, logger="stepguard"):
        assert guard.resume(str(tmp_path)) == 0
    assert [r.getMessage() for r in caplog.records if r.name == "stepguard"] == [
        "no valid checkpoint to resume in %s: starting fresh" % tmp_path]


def test_the_logger_is_silenced_like_any_other(caplog):
    model = make_model(13)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), policy_yaml=POLICY)
    logging.getLogger("stepguard").setLevel(logging.ERROR)
    try:
        with caplog.at_level(logging.WARNING):
            assert _step(guard, model, 1, "nan_grad").skipped
        assert [r for r in caplog.records if r.name == "stepguard"] == []
    finally:
        logging.getLogger("stepguard").setLevel(logging.NOTSET)

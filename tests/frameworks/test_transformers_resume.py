"""The real HF Trainer, one process on CPU, with the Trainer's defaults (max_grad_norm=1.0, a
linear schedule): the guard's state rides in every Trainer checkpoint and comes back on
resume_from_checkpoint (a run resumed at step 4 ends bitwise where the uninterrupted run ends,
LR factor, budgets, step numbers and data position included); the guard's own loss scaling is
refused; the verdict is taken where the Trainer measures its grad norm, and the norm is not
measured a second time."""

import math
import os

import pytest
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hf_worker import RandomTokens
from stepguard.integrations.transformers import StepguardCallback

MAX_STEPS, SAVE_AT, NAN_AT = 8, 4, 2
# A NaN step is skipped and halves the LR factor for the rest of this short run.
POLICY = """
version: 1
rules:
  - {name: skip-nonfinite, on: nonfinite, action: skip_batch}
  - {name: halve-lr, on: nonfinite, action: lower_lr, factor: 0.5, floor: 0.05,
     recover_after: 50, recover_over: 200}
"""


class NanTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step + 1 == NAN_AT:
            loss = loss * float("nan")
        return loss


pytestmark = pytest.mark.usefixtures("hf_offline")


def _model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _trainer(out, **guard):
    args = TrainingArguments(
        output_dir=str(out), max_steps=MAX_STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, save_strategy="steps", save_steps=SAVE_AT, logging_steps=1,
        report_to=[], use_cpu=True, seed=7, dataloader_num_workers=0, disable_tqdm=True)
    trainer = NanTrainer(model=_model(), args=args,
                         train_dataset=RandomTokens(64, 16, 64))
    callback = StepguardCallback(policy_yaml=POLICY, **guard).attach(trainer)
    return trainer, callback


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _figures(guard):
    s = guard.stats()
    return {"step_count": s.step_count, "lr_factor": s.lr_factor,
            "data_position": s.data_position, "totals": s.totals.to_dict()}


def test_a_resumed_trainer_run_ends_bitwise_where_the_uninterrupted_one_ends(tmp_path):
    whole, whole_cb = _trainer(tmp_path / "whole")
    whole.train()
    assert os.path.isfile(tmp_path / "whole" / "checkpoint-4" / "stepguard_rank0.pt")
    assert whole_cb.guard.stats().lr_factor == 0.5

    resumed, resumed_cb = _trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / ("checkpoint-%d" % SAVE_AT)))
    assert torch.equal(_flat(resumed.model), _flat(whole.model))
    assert _figures(resumed_cb.guard) == _figures(whole_cb.guard)
    assert resumed_cb.last_report.step == MAX_STEPS
    # The LR the scheduler reached counts applied steps only, in both runs alike.
    assert resumed.lr_scheduler.get_last_lr() == whole.lr_scheduler.get_last_lr()


def test_a_checkpoint_saved_without_the_guard_resumes_with_a_fresh_guard(tmp_path):
    plain = NanTrainer(model=_trainer(tmp_path / "x")[0].model, args=TrainingArguments(
        output_dir=str(tmp_path / "plain"), max_steps=1, save_strategy="steps", save_steps=1,
        report_to=[], use_cpu=True, disable_tqdm=True, per_device_train_batch_size=4),
        train_dataset=RandomTokens(64, 16, 64))
    plain.train()
    trainer, callback = _trainer(tmp_path / "guarded")
    with pytest.warns(RuntimeWarning, match="checkpoint-1 holds no guard state"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1"))
    assert callback.guard.stats().step_count == MAX_STEPS - 1


def test_the_guards_own_loss_scaling_is_refused_under_the_trainer(tmp_path):
    trainer, _ = _trainer(tmp_path / "scaled", loss_scaling=True)
    with pytest.raises(Exception, match="leave loss_scaling off"):
        trainer.train()


def test_the_trainer_measures_no_second_grad_norm(tmp_path, monkeypatch):
    """The verdict's agreed norm is what the Trainer logs and clips with: torch's norm
    functions are not called in the step (but on a step with a non-finite gradient, whose norm
    the Trainer logs as accelerate alone would: Inf or NaN)."""
    calls = []
    for name in ("get_total_norm", "clip_grad_norm_"):
        original = getattr(torch.nn.utils, name)
        monkeypatch.setattr(torch.nn.utils, name,
                            lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    trainer, callback = _trainer(tmp_path / "norm")
    trainer.train()
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert len(logged) == MAX_STEPS
    nonfinite = [n for n in logged if not math.isfinite(n)]
    assert calls == ["get_total_norm"] * len(nonfinite), (calls, logged)
    assert callback.guard.stats().collective_calls == MAX_STEPS  # one per step
    assert callback.last_report.grad_norm == pytest.approx(logged[-1], rel=1e-6)


def test_a_step_of_the_optimizer_behind_the_guard_is_refused(tmp_path):
    """As accelerate's optimizer-step wrapper would make, stepping the optimizer it captured at
    setup: an error naming it, not a step the guard never judged."""
    class Bypass(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            optimizer.optimizer.optimizer.step()  # AcceleratedOptimizer -> guard -> AdamW

    trainer, _ = _trainer(tmp_path / "bypass")
    trainer.add_callback(Bypass())
    with pytest.raises(RuntimeError, match="stepped the wrapped AdamW outside the guard"):
        trainer.train()


def test_a_second_train_on_the_same_trainer_resumes_the_guard_too(tmp_path):
    """train(resume_from_checkpoint=...) again on a Trainer that already trained: the guard's
    state comes from that checkpoint, as on a fresh Trainer (not the first run's end)."""
    whole, whole_cb = _trainer(tmp_path / "whole")
    whole.train()
    expected = _figures(whole_cb.guard)
    whole.train(resume_from_checkpoint=str(tmp_path / "whole" / ("checkpoint-%d" % SAVE_AT)))
    assert _figures(whole_cb.guard) == expected
    assert whole_cb.last_report.step == MAX_STEPS


class _RaiseOnce(transformers.TrainerCallback):
    """Raises between the Trainer's clip (where the verdict is taken) and its step, once."""

    def __init__(self, at):
        self.at, self.raised = at, False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.at and not self.raised:
            self.raised = True
            raise RuntimeError("interrupted between the clip and the step")


def test_a_step_interrupted_before_its_update_is_neither_judged_nor_applied(tmp_path):
    """An exception in an on_pre_optimizer_step callback, after the Trainer's clip: the verdict
    (taken in the Trainer's optimizer.step()) never came, nothing was applied, and the next
    train() does not reuse the interrupted step's clip."""
    trainer, callback = _trainer(tmp_path / "interrupted")
    trainer.add_callback(_RaiseOnce(at=3))
    before = None

    class Keep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            nonlocal before
            before = _flat(trainer.model)

    trainer.add_callback(Keep())
    with pytest.raises(RuntimeError, match="between the clip and the step"):
        trainer.train()
    stats = callback.guard.stats()  # step 3 clipped by the Trainer, never judged
    assert callback.guard.deferred is not None and callback.guard.pending is None
    assert stats.step_count == 2 and stats.totals.steps == 2
    assert torch.equal(_flat(trainer.model), before)  # as step 2 left it
    trainer.train()  # a fresh run on the same Trainer (8 steps, the NaN at its step 2 again)
    stats = callback.guard.stats()
    assert stats.step_count == 2 + MAX_STEPS and callback.last_report.step == 2 + MAX_STEPS
    assert stats.totals.skipped == 2  # the NaN steps of both runs
    assert bool(torch.isfinite(_flat(trainer.model)).all())


def test_step_hooks_on_the_guard_fire_once_per_trainer_step(tmp_path):
    events = []

    class Hooks(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            guard = optimizer.optimizer
            guard.register_step_pre_hook(lambda *a: events.append("pre"))
            guard.register_step_post_hook(lambda *a: events.append("post"))

    trainer, callback = _trainer(tmp_path / "hooks")
    trainer.add_callback(Hooks())
    trainer.train()
    assert events == ["pre", "post"] * MAX_STEPS


@pytest.mark.parametrize("package", ["transformers", "accelerate"])
def test_a_release_older_than_the_tested_ones_is_refused_at_train_begin(tmp_path, monkeypatch,
                                                                        package):
    from stepguard.integrations import _core

    installed = _core.installed_version
    found = {package: "1.0.0"}
    monkeypatch.setattr(_core, "installed_version", lambda p: found.get(p) or installed(p))
    trainer, _ = _trainer(tmp_path / "old")
    with pytest.raises(RuntimeError, match=r"%s 1\.0\.0 is older than the releases tested"
                                           % package):
        trainer.train()
    found[package] = "99.0.0"
    trainer, callback = _trainer(tmp_path / "new")
    with pytest.warns(RuntimeWarning, match=r"%s 99\.0\.0 is newer than the releases tested"
                                            % package):
        trainer.train()
    assert callback.last_report.step == MAX_STEPS


def test_framework_norm_is_the_trainers_own_clip_bitwise(tmp_path):
    """StepguardCallback(framework_norm=True) with a binding max_grad_norm: accelerate's own norm
    and clip, so the parameters are bitwise an unguarded Trainer's; the default (the agreed
    norm) is not asked to be."""
    def run(out, guard):
        args = TrainingArguments(
            output_dir=str(out), max_steps=4, per_device_train_batch_size=4, max_grad_norm=0.01,
            learning_rate=1e-3, save_strategy="no", logging_steps=1, report_to=[],
            use_cpu=True, seed=7, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=_model(), args=args, train_dataset=RandomTokens(64, 16, 64))
        callback = None
        if guard:
            callback = StepguardCallback(policy="default", framework_norm=True).attach(trainer)
        trainer.train()
        logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
        return _flat(trainer.model), logged, callback
    guarded, guarded_norms, callback = run(tmp_path / "guarded", True)
    plain, plain_norms, _ = run(tmp_path / "plain", False)
    assert min(plain_norms) > 0.01  # the clip binds on every step
    assert guarded_norms == plain_norms
    assert torch.equal(guarded, plain)
    assert callback.guard.stats().totals.to_dict()["applied"] == 4
    with pytest.raises(TypeError, match="framework_norm must be a bool"):
        StepguardCallback(framework_norm=1)


@pytest.mark.parametrize("attached", [False, True])
def test_fp16_with_accelerates_scaler_one_process_with_and_without_attach(tmp_path, attached):
    """fp16=True with the Trainer's default clip (max_grad_norm=1.0), accelerate's fp16 set up
    as on a GPU (hf_worker.fp16_on_cpu). Without attach() the Trainer's own clip unscales the
    gradients first and the guard takes its verdict after it (no second unscale_); with it the
    guard's verdict stands where the Trainer measures the norm. Either way the startup overflow
    steps are the scaler's, skipped, and every report carries the scaler's scale."""
    from hf_worker import fp16_on_cpu

    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=MAX_STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, save_strategy="no", logging_steps=1, report_to=[], use_cpu=True,
        seed=7, dataloader_num_workers=0, disable_tqdm=True, fp16=True)
    trainer = Trainer(model=_model(), args=args,
                      train_dataset=RandomTokens(64, 16, 64))
    fp16_on_cpu(trainer)
    callback = StepguardCallback(policy="default")
    if attached:
        callback.attach(trainer)
    else:
        trainer.add_callback(callback)
    scales = []

    class Scales(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            report = callback.last_report
            scales.append((report.outcome, report.loss_scale,
                           trainer.accelerator.scaler.get_scale()))

    trainer.add_callback(Scales())
    trainer.train()
    assert len(scales) == MAX_STEPS
    outcomes = [o for o, _, _ in scales]
    streak = outcomes.index("applied")
    assert streak >= 3 and set(outcomes[streak:]) == {"applied"}, scales
    # The report's scale is the one of the step's backward; the scaler halves it on a skip.
    before = [2.0 ** 24] + [after for _, _, after in scales[:-1]]
    assert [s for _, s, _ in scales] == before, scales
    assert all(after == s / 2 for o, s, after in scales if o == "skipped"), scales
    totals = callback.guard.stats().totals.to_dict()
    assert totals["skipped"] == streak and totals["applied"] == MAX_STEPS - streak
    # The Trainer logs the overflow steps' norm as accelerate alone does: not finite.
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert len(logged) == MAX_STEPS, logged
    assert all(not math.isfinite(n) for n in logged[:streak]), logged
    assert all(math.isfinite(n) for n in logged[streak:]), logged

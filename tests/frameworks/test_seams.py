"""Declared seams (stepguard.integrations._seams), with the real HF Trainer and Lightning, one
process on CPU: what attach touches on the framework's objects is what the seams table declares
(every attribute that differs from an unguarded twin's after the same steps), detach() puts it
all back, a second callback on the same Trainer is refused, and a framework function that
changed since the tested releases (a modified copy put in its place) is refused at attach,
naming it, unless the user opts in."""

import math
import types

import pytest
import torch
import lightning.pytorch as pl
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)

from hf_worker import RandomTokens
from stepguard.integrations import _seams
from stepguard.integrations import lightning as sg_lightning
from stepguard.integrations import transformers as sg_transformers
from test_lightning import Net

STEPS = 3


pytestmark = pytest.mark.usefixtures("hf_offline")


def _identities(obj):
    return {name: id(value) for name, value in vars(obj).items()}


def _changed(before, obj):
    now = _identities(obj)
    return {name for name in set(before) | set(now) if before.get(name) != now.get(name)}


def _declared(framework):
    """The attribute names the seams table declares written or replaced."""
    return {seam.where.rsplit(".", 1)[1] for seam in _seams.SEAMS[framework]
            if seam.kind in ("writes", "replaces")}


# --- HF Trainer -----------------------------------------------------------------------------
def _hf_trainer(out, **arguments):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                       n_positions=32, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                             seed=7, dataloader_num_workers=0, disable_tqdm=True,
                             **arguments)
    return Trainer(model=model, args=args, train_dataset=RandomTokens(64, 16, 64))


def _hf_objects(trainer):
    return {"trainer": trainer, "accelerator": trainer.accelerator,
            "callback_handler": trainer.callback_handler}


def test_hf_attach_touches_declared_seams_only_and_detach_puts_them_back(tmp_path):
    guarded, twin = _hf_trainer(tmp_path / "guarded"), _hf_trainer(tmp_path / "twin")
    before = {k: _identities(o) for k, o in _hf_objects(guarded).items()}
    twin_before = {k: _identities(o) for k, o in _hf_objects(twin).items()}
    callbacks_before = list(guarded.callback_handler.callbacks)
    callback = sg_transformers.StepguardCallback().attach(guarded)
    guarded.train()
    twin.train()
    declared = _declared("transformers")
    framework_own = {}  # what training changes without the guard too (trainer.optimizer, ...)
    for name, obj in _hf_objects(guarded).items():
        framework_own[name] = _changed(twin_before[name], _hf_objects(twin)[name])
        ours = _changed(before[name], obj) - framework_own[name]
        assert ours <= declared, (name, ours - declared)
    accelerated = guarded.optimizer  # the AcceleratedOptimizer the Trainer stepped
    assert accelerated.optimizer is callback.guard
    assert callback.guard.stats().totals.applied == STEPS
    assert guarded.callback_handler.callbacks[0] is callback

    callback.detach()
    for name, obj in _hf_objects(guarded).items():
        now = _identities(obj)
        for attr in declared - framework_own[name]:
            assert now.get(attr) == before[name].get(attr), (name, attr)
    assert guarded.callback_handler.callbacks == callbacks_before
    assert accelerated.optimizer is callback.guard.optimizer
    assert set(vars(accelerated)) == set(vars(twin.optimizer))
    assert not accelerated.optimizer._optimizer_step_pre_hooks  # the bypass watch is gone

    # Attached again: the same guard goes on (a second train() runs its 2 * STEPS from 0).
    callback.attach(guarded)
    guarded.args.max_steps = 2 * STEPS
    guarded.train()
    assert callback.guard.stats().step_count == 3 * STEPS
    assert guarded.optimizer.optimizer is callback.guard


def test_hf_a_second_callback_on_the_same_trainer_is_refused(tmp_path):
    trainer = _hf_trainer(tmp_path)
    first = sg_transformers.StepguardCallback().attach(trainer)
    assert first.attach(trainer) is first
    with pytest.raises(RuntimeError, match="has a StepguardCallback attached already"):
        sg_transformers.StepguardCallback().attach(trainer)
    with pytest.raises(RuntimeError, match="attached to another Trainer"):
        first.attach(_hf_trainer(tmp_path / "other"))
    first.detach()
    sg_transformers.StepguardCallback().attach(trainer)  # after detach(): another may


def test_hf_a_changed_framework_function_is_refused_at_attach_naming_it(tmp_path, monkeypatch):
    original = Trainer.training_step

    def training_step(self, *args, **kwargs):  # a release that changed the method
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", training_step)
    trainer = _hf_trainer(tmp_path)
    with pytest.raises(RuntimeError, match=r"transformers\.trainer\.Trainer\.training_step: its "
                                           r"code differs .* relied on to replaces"):
        sg_transformers.StepguardCallback().attach(trainer)
    assert "training_step" not in vars(trainer) and "clip_grad_norm_" not in vars(
        trainer.accelerator)
    with pytest.warns(RuntimeWarning, match="allow_untested_framework=True: running anyway"):
        callback = sg_transformers.StepguardCallback(allow_untested_framework=True)
        callback.attach(trainer)
    trainer.train()
    assert callback.guard.stats().totals.applied == STEPS


def test_hf_a_step_whose_loss_never_reached_the_guard_is_an_error(tmp_path):
    """attach() hands the guard each micro-batch's loss through trainer.training_step: a Trainer
    that trains without calling it (here: the patch undone behind the callback's back, as a
    release that calls another method would) is stopped at the first step, before anything is
    judged or applied, instead of a verdict on the gradients alone."""
    trainer = _hf_trainer(tmp_path)
    callback = sg_transformers.StepguardCallback().attach(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.training_step = types.MethodType(Trainer.training_step, trainer)
    with pytest.raises(RuntimeError, match=r"no loss reached the guard for step 1: "
                                           r"callback\.attach\(trainer\) hands"):
        trainer.train()
    assert callback.guard.stats().step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


class _NaNBeforeTheUpdate(TrainerCallback):
    """A user's callback that changes a gradient after the Trainer's clip, in
    on_pre_optimizer_step (here: NaN into one element at step 2)."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:  # the Trainer's second step
            next(model.parameters()).grad.view(-1)[3] = float("nan")


@pytest.mark.parametrize("framework_norm", [False, True])
def test_hf_a_gradient_changed_in_on_pre_optimizer_step_is_judged(tmp_path, framework_norm):
    """The verdict is taken in the Trainer's optimizer.step(), after every on_pre_optimizer_step
    callback (the Trainer's clip, where the norm is measured, runs before them): a NaN put there
    is skipped, not applied, and the Trainer logs a NaN norm for that step; the clean steps
    around it are applied with the norm the guard agreed (accelerate's own with
    framework_norm)."""
    trainer = _hf_trainer(tmp_path, logging_steps=1)
    callback = sg_transformers.StepguardCallback(framework_norm=framework_norm).attach(trainer)
    trainer.add_callback(_NaNBeforeTheUpdate())  # after the guard's, as a user adds one
    params = []
    trainer.add_callback(type("Record", (TrainerCallback,), {"on_step_end": lambda *a, **k: (
        params.append([p.detach().clone() for p in trainer.model.parameters()]))}))
    trainer.train()
    totals = callback.guard.stats().totals
    assert (totals.applied, totals.skipped) == (STEPS - 1, 1)
    assert all(torch.isfinite(p).all() for step in params for p in step)
    assert all(torch.equal(a, b) for a, b in zip(params[0], params[1]))  # step 2 not applied
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    outcomes = [e["stepguard/outcome"] for e in trainer.state.log_history if "grad_norm" in e]
    assert len(logged) == STEPS and math.isnan(logged[1]), logged
    assert outcomes == ["applied", "skipped", "applied"], outcomes
    assert all(math.isfinite(n) and n > 0 for n in (logged[0], logged[2])), logged


# --- Lightning ------------------------------------------------------------------------------
def _lightning_trainer(root, callbacks):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, gradient_clip_val=1.0,
                      callbacks=callbacks, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(root))


def test_lightning_fit_touches_declared_seams_only_and_teardown_puts_them_back(tmp_path):
    seen = {"guarded": {}, "twin": {}}

    class During(pl.Callback):  # what a fit looks like while it runs, guarded and not
        def __init__(self, run):
            self.run = run

        def on_train_batch_end(self, trainer, pl_module, *args):
            start = before if self.run == "guarded" else twin_before
            seen[self.run].update({k: _changed(start[k], o)
                                   for k, o in watched(trainer, pl_module).items()})

    callback = sg_lightning.StepguardCallback()
    guarded = _lightning_trainer(tmp_path / "g", [callback, During("guarded")])
    twin = _lightning_trainer(tmp_path / "t", [During("twin")])
    model, twin_model = Net(), Net()
    watched = lambda t, m: {"strategy": t.strategy, "precision": t.precision_plugin,  # noqa
                            "module": m}
    before = {k: _identities(o) for k, o in watched(guarded, model).items()}
    twin_before = {k: _identities(o) for k, o in watched(twin, twin_model).items()}
    guarded.fit(model)
    twin.fit(twin_model)
    # While fitting: the declared instance attributes, and the strategy's optimizer list (the
    # property's storage) the declared "optimizers" seam writes.
    declared = _declared("lightning") | {"_optimizers", "_lightning_optimizers"}
    framework_own = {}
    for name in seen["guarded"]:
        framework_own[name] = (seen["twin"][name]
                               | _changed(twin_before[name], watched(twin, twin_model)[name]))
        ours = seen["guarded"][name] - framework_own[name]
        assert ours <= declared, (name, ours - declared)
    assert "clip_grad_by_norm" in seen["guarded"]["precision"]
    assert "lr_scheduler_step" in seen["guarded"]["module"]
    # After fit (teardown ran detach()): none of the instance attributes is left, the strategy
    # steps the plain optimizer, and the bypass watch is gone.
    for name, obj in watched(guarded, model).items():
        now = _identities(obj)
        for attr in _declared("lightning") - framework_own[name]:
            assert now.get(attr) == before[name].get(attr), (name, attr)
    (plain,) = guarded.strategy.optimizers
    assert plain is callback.guards[0].optimizer and type(plain) is torch.optim.SGD
    assert not plain._optimizer_step_pre_hooks
    assert callback.guards[0].stats().totals.applied == STEPS


def test_lightning_a_changed_framework_function_is_refused_at_fit_naming_it(tmp_path,
                                                                            monkeypatch):
    from lightning.pytorch.plugins.precision import precision

    original = precision.Precision.clip_grad_by_norm

    def clip_grad_by_norm(self, optimizer, clip_val):  # a release that changed the method
        return original(self, optimizer, clip_val)

    monkeypatch.setattr(precision.Precision, "clip_grad_by_norm", clip_grad_by_norm)
    callback = sg_lightning.StepguardCallback()
    trainer = _lightning_trainer(tmp_path, [callback])
    with pytest.raises(RuntimeError, match=r"Precision\.clip_grad_by_norm: its code differs"):
        trainer.fit(Net())
    assert "clip_grad_by_norm" not in vars(trainer.precision_plugin)
    callback = sg_lightning.StepguardCallback(allow_untested_framework=True)
    trainer = _lightning_trainer(tmp_path, [callback])
    with pytest.warns(RuntimeWarning, match="allow_untested_framework=True: running anyway"):
        trainer.fit(Net())
    assert callback.guards[0].stats().totals.applied == STEPS


def test_the_docs_list_the_seams_table():
    import os
    import re
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "frameworks.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    for framework in ("torch", "transformers", "lightning", "deepspeed", "megatron", "torchtitan"):
        section = text.split("<!-- seams: %s -->" % framework, 1)[1].split("<!-- seams:", 1)[0]
        listed = set(re.findall(r"^- `([^`]+)` \((\w+)\)", section, flags=re.M))
        table = {(seam.where, seam.kind) for seam in _seams.SEAMS[framework]}
        assert listed == table, (framework, listed ^ table)


# docs/frameworks.md's table of each framework's modules (lines), declared seams and private names.
_MODULES = [("every framework", None, ["_core.py", "_clip.py", "_seams.py"]),
            ("torch's GradScaler", "torch", ["stepguard/_amp.py"]),
            ("HF Transformers", "transformers", ["transformers.py"]),
            ("Lightning", "lightning", ["lightning.py"]),
            ("DeepSpeed", "deepspeed", ["deepspeed.py", "_deepspeed_layouts.py",
                                        "_seams_deepspeed.py"]),
            ("Megatron-core", "megatron", ["megatron.py", "_chain.py", "_seams_megatron.py"]),
            ("torchtitan", "torchtitan", ["torchtitan.py", "_seams_torchtitan.py"])]


def test_the_docs_list_each_frameworks_modules_seams_and_private_names():
    import os
    import stepguard
    package = os.path.dirname(stepguard.__file__)
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "frameworks.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    listed = text.split("<!-- integration-modules -->", 1)[1].split("<!-- /integration-", 1)[0]
    rows = ["| framework | modules (lines) | seams | private names |", "|---|---|---|---|"]
    for name, key, files in _MODULES:
        cells = []
        for file in files:
            path = os.path.join(os.path.dirname(package) if "/" in file else
                                os.path.join(package, "integrations"), file)
            with open(path, encoding="utf-8") as f:
                cells.append("`%s` (%d)" % (file, len(f.read().splitlines())))
        seams = _seams.SEAMS.get(key, [])
        private = {s.where for s in seams if any(p.startswith("_") for p in s.where.split("."))}
        counts = ("%d | %d" % (len(seams), len(private))) if key else "|"
        rows.append("| %s | %s | %s |" % (name, ", ".join(cells), counts))
    assert listed.strip().splitlines() == rows, "\n".join(rows)

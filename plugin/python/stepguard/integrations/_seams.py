"""Declared seams: what each framework integration touches that the framework does not offer as
a public extension point, as data, checked before use and undone after.

A ``Seam`` names one framework attribute an integration reads privately, replaces or writes,
what it is for, and the framework function whose behaviour it relies on, with the fingerprints
(a hash of that function's source) of the releases it was tested on. ``check_seams`` runs at
attach: a seam whose function is missing or whose source changed is refused with the list of
changed seams and what each is for (``allow_untested_framework=True`` runs anyway, with a loud
warning). ``Patches`` writes attributes on framework objects and restores every one at
``detach()``. The lists in docs/frameworks.md of what each integration touches are tested against
the table (tests/frameworks/test_seams.py).
"""

import hashlib
import importlib
import inspect
import textwrap
import warnings
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Tuple

__all__ = ["Seam", "SEAMS", "TESTED_SOURCES", "fingerprint", "resolve", "check_seams",
           "changed_functions", "Patches"]


@dataclass(frozen=True)
class Seam:
    """One framework attribute an integration depends on beyond the framework's public API.

    ``where``: the attribute (``module.Class.attribute``; an instance's, for what is written on
    an object); ``kind``: how it is used (``replaces`` a method on an instance, ``writes`` an
    attribute, ``reads`` a private attribute, ``calls`` a private function, ``follows`` a
    public method's exact behaviour); ``purpose``: what it is for, in a line; ``relies_on``: the
    framework functions (dotted paths) whose code defines the behaviour relied on, each
    fingerprinted in ``TESTED_SOURCES``; ``restored``: whether ``detach()`` puts it back (a
    read or a call needs nothing)."""

    where: str
    kind: str
    purpose: str
    relies_on: Tuple[str, ...]
    restored: bool = True


def resolve(dotted):
    """The object at ``dotted`` (``package.module.Class.method``): the longest importable module
    prefix, then attributes. Raises ImportError or AttributeError naming what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = inspect.getattr_static(obj, name) if inspect.isclass(obj) else getattr(obj, name)
            obj = getattr(obj, "__func__", obj)  # a staticmethod or classmethod: its function
            if isinstance(obj, property):
                obj = obj.fget
        return obj
    raise ImportError("no module of %r imports" % dotted)


def _source(obj):
    """``obj``'s source, dedented, line endings normalised; a decorator's wrapper that keeps the
    function in its closure (DeepSpeed's ``instrument_w_nvtx``, without functools.wraps) adds
    the wrapped function's source, so that a change of either shows."""
    source = textwrap.dedent(inspect.getsource(obj)).replace("\r\n", "\n")
    code, cells = getattr(obj, "__code__", None), getattr(obj, "__closure__", None)
    if code is not None and cells and not hasattr(obj, "__wrapped__"):
        for name, cell in zip(code.co_freevars, cells):
            inner = cell.cell_contents if name in ("func", "fn", "f") else None
            if inspect.isfunction(inner):
                source += "\n" + _source(inner)
    return source


def fingerprint(obj):
    """16 hex digits of the SHA-256 of ``obj``'s source (``_source``): a change of the
    function's code (not of the file around it) changes it."""
    return hashlib.sha256(_source(obj).encode("utf-8")).hexdigest()[:16]


def changed_functions(framework) -> List[Tuple[str, str]]:
    """The functions ``framework``'s seams rely on whose code is missing or differs from every
    tested release's, each with what was found (a fingerprint, or "missing (...)")."""
    out = []
    for path, tested in TESTED_SOURCES[framework].items():
        try:
            found = fingerprint(resolve(path))
        except (ImportError, AttributeError, OSError, TypeError) as e:
            found = "missing (%s: %s)" % (type(e).__name__, e)
        if found not in tested:
            out.append((path, found))
    return out


def check_seams(framework, allow_untested=False):
    """Refuses a ``framework`` release whose seams changed: RuntimeError naming each changed
    function and what the integration uses it for; with ``allow_untested`` a loud warning
    instead."""
    changed = changed_functions(framework)
    if not changed:
        return
    lines = []
    for path, found in changed:
        uses = ["%s %s (%s)" % (seam.kind, seam.where, seam.purpose)
                for seam in SEAMS[framework] if path in seam.relies_on]
        lines.append("  %s: %s; relied on to %s" % (
            path, "not found" if found.startswith("missing") else "its code differs from the "
            "tested releases'", "; ".join(uses) or "guard the step"))
    message = ("stepguard: %d of the %s functions the integration relies on changed since the "
               "releases it was tested on, so a guarded step could differ from the framework's "
               "own without a word:\n%s" % (len(changed), framework, "\n".join(lines)))
    if not allow_untested:
        raise RuntimeError(message + "\nInstall a tested release (README, Supported versions), "
                           "or pass allow_untested_framework=True to run anyway at your risk")
    warnings.warn(message + "\nallow_untested_framework=True: running anyway", RuntimeWarning,
                  stacklevel=3)


_ABSENT = object()


class Patches:
    """The attributes an integration set on framework objects, each with what was there before
    (or that nothing was, in the object's own ``__dict__``). ``restore()`` puts every one back,
    newest first; an attribute that someone else changed since is left as it is. Not
    thread-safe."""

    def __init__(self):
        self._undo = []

    def set(self, obj, name, value):
        """``obj.name = value`` in the object's own ``__dict__`` (an instance attribute in front
        of the class's)."""
        before = vars(obj).get(name, _ABSENT)
        setattr(obj, name, value)
        self._undo.append((obj, name, before, value, False))

    def set_property(self, obj, name, value):
        """``obj.name = value`` through the class's property setter; restored the same way."""
        before = getattr(obj, name)
        setattr(obj, name, value)
        self._undo.append((obj, name, before, value, True))

    def restore(self):
        while self._undo:
            obj, name, before, value, through_property = self._undo.pop()
            now = getattr(obj, name) if through_property else vars(obj).get(name, _ABSENT)
            if now is not value:
                continue  # changed again since: not ours to undo
            if before is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, before)


# --- The tables -------------------------------------------------------------------------------
# The fingerprints of the tested releases (README, Supported versions). A new tested release adds
# its fingerprints: `python -m stepguard.integrations._seams FRAMEWORK` prints them.

_T = "transformers.trainer.Trainer."
_A = "accelerate.optimizer.AcceleratedOptimizer."
_L = "lightning.pytorch."
_P = _L + "plugins.precision."
_G = "torch.amp.grad_scaler."
_D = "accelerate.utils.deepspeed."

TESTED_SOURCES: Dict[str, Dict[str, FrozenSet[str]]] = {
    "torch": {  # torch 2.11 to 2.15 (the GradScaler every fp16 path follows): from 2.11 to
        # 2.15 these functions changed in type annotations and comments only
        _G + "_refresh_per_optimizer_state": {"05f47f57e3acce72"},
        _G + "GradScaler.step": {"80cfc1b352a30253", "5eeec9507c88acc2", "da79c11f105af61a"},
        _G + "GradScaler.unscale_": {"a77af99eefc53b5a", "a92e0a34cc0ff79b"},
        _G + "GradScaler.update": {"a23591b2659c08b7", "bc164e9303e930f9"},
        _G + "GradScaler._get_scale_async": {"e7b828f54abaffc8", "2a31ddcf0563175a"},
    },
    "transformers": {  # transformers 5.24.0, accelerate 1.15.0
        _D + "DeepSpeedEngineWrapper.backward": {"c0a15bc3d4837d6d"},
        _D + "DeepSpeedOptimizerWrapper.step_was_skipped": {"e43ba2a8155e3465"},
        _D + "DeepSpeedOptimizerWrapper.__init__": {"60c52724e6651083"},
        "transformers.trainer_callback.CallbackHandler.call_event": {"071d54bba7a7274b"},
        _T + "training_step": {"caa7e68f3335f9ae"},
        _T + "_run_epoch": {"20e0f3da01994864"},
        _T + "train": {"0bc847a1e101c362"},
        "transformers.trainer_utils.get_last_checkpoint": {"8b16bf27680b5364"},
        _T + "_clip_grad_norm": {"df0a0246dbcb0b20"},
        "accelerate.accelerator.Accelerator.clip_grad_norm_": {"710e0e508d9e83d2"},
        _A + "__init__": {"ffae36432569a267"},
        _A + "step": {"0d6549819d99c889"},
        "accelerate.optimizer.patch_optimizer_step": {"3a48a3aa2ccaeca8"},
        _A + "step_was_skipped": {"dee6589f6adff7ba"},
        "accelerate.accelerator.Accelerator.optimizer_step_was_skipped": {"c496ac918e042a8c"},
        _T + "_save_checkpoint": {"4638fc7aeef978e1"},
    },
    "lightning": {  # lightning 2.6.6
        _L + "core.optimizer.LightningOptimizer.__init__": {"b4a436a4e09620c7"},
        _L + "core.optimizer.LightningOptimizer._to_lightning_optimizer": {"12c6e39743d4ebfa"},
        _L + "strategies.strategy.Strategy.setup_optimizers": {"ce518cfc7a73392b"},
        _L + "strategies.strategy.Strategy.optimizer_step": {"863e2bc22bf7e4a3"},
        _P + "precision.Precision.clip_gradients": {"27a233b1437d55ff"},
        _P + "precision.Precision.clip_grad_by_norm": {"62fdc7f656345e0a"},
        _P + "precision.Precision._after_closure": {"2695d1e2e327538b"},
        _P + "precision.Precision._clip_gradients": {"ef7b85c1a469d1f7"},
        _P + "amp.MixedPrecision.clip_gradients": {"cfabb905497e4a49"},
        _P + "amp.MixedPrecision.optimizer_step": {"45508e4e497b2905"},
        _L + "loops.training_epoch_loop._TrainingEpochLoop._update_learning_rates":
            {"39d655cf218adad0"},
        _L + "loops.optimization.automatic._AutomaticOptimization._optimizer_step":
            {"22d56e420c87bb4b"},
        _L + "core.module.LightningModule.lr_scheduler_step": {"06ccae3fd55c26e1"},
        _L + "trainer.trainer.Trainer._run": {"0e40bcef34b9204d"},
        _P + "deepspeed.DeepSpeedPrecision.backward": {"9c20e5c7253ee0e9"},
        _P + "deepspeed.DeepSpeedPrecision.optimizer_step": {"589337edf4caeb87"},
        _L + "strategies.deepspeed.DeepSpeedStrategy._initialize_deepspeed_train":
            {"1cc70fcd1d0fcefd"},
    },
}

SEAMS: Dict[str, List[Seam]] = {
    "torch": [
        Seam(_G + "GradScaler.step", "follows",
             "_step_supports_amp_scaling: the scaler calls the guard's step on every step, the "
             "ones it would leave out included", (_G + "GradScaler.step",), restored=False),
        Seam(_G + "GradScaler._per_optimizer_states", "reads",
             "whether unscale_ ran this step (its stage), so that it runs once",
             (_G + "_refresh_per_optimizer_state", _G + "GradScaler.unscale_"), restored=False),
        Seam(_G + "GradScaler._per_optimizer_states", "writes",
             "an overflow of any rank is recorded in every rank's found-inf tensors, so that "
             "every rank's update() backs off", (_G + "GradScaler.step", _G + "GradScaler.update"),
             restored=False),
        Seam(_G + "GradScaler._get_scale_async", "calls",
             "the scale as a device tensor, to unscale a scaled loss and to carry the step's "
             "scale in the step buffer without a host read",
             (_G + "GradScaler._get_scale_async",), restored=False),
    ],
    "transformers": [
        Seam("transformers.trainer_callback.CallbackHandler.callbacks", "writes",
             "the callback goes first, so that reporters see its log entries",
             ("transformers.trainer_callback.CallbackHandler.call_event",)),
        Seam(_T + "training_step", "replaces",
             "each micro-batch's loss reaches the guard (no callback event carries it)",
             (_T + "training_step", _T + "_run_epoch")),
        Seam(_T + "train", "replaces",
             "the checkpoint train() resumes from, which no callback event names",
             (_T + "train", "transformers.trainer_utils.get_last_checkpoint")),
        Seam("accelerate.accelerator.Accelerator.clip_grad_norm_", "replaces",
             "the Trainer's clip hands back the norm the verdict fills; the verdict and the "
             "clip run in the guarded step, after the on_pre_optimizer_step callbacks",
             (_T + "_clip_grad_norm", "accelerate.accelerator.Accelerator.clip_grad_norm_",
              _T + "_run_epoch")),
        Seam(_A + "optimizer", "writes",
             "the Trainer's optimizer.step() is the guarded step", (_A + "__init__", _A + "step")),
        Seam(_A + "_optimizer_original_step_method", "writes",
             "fp16: the GradScaler steps the guard, not the step captured at setup",
             (_A + "__init__", _A + "step")),
        Seam(_A + "_optimizer_patched_step_method", "writes",
             "fp16: the same, through accelerate's own step patch",
             ("accelerate.optimizer.patch_optimizer_step", _A + "step")),
        Seam(_A + "_is_overflow", "writes",
             "a step the guard did not apply holds the Trainer's LR schedule",
             (_A + "step_was_skipped",
              "accelerate.accelerator.Accelerator.optimizer_step_was_skipped", _T + "_run_epoch")),
        Seam(_T + "_save_checkpoint", "follows",
             "the guard's state file goes into the folder the Trainer just wrote",
             (_T + "_save_checkpoint",), restored=False),
        Seam(_D + "DeepSpeedEngineWrapper.backward", "follows",
             "DeepSpeed: the Trainer's backward runs the engine's backward and step, where the "
             "guard decides", (_D + "DeepSpeedEngineWrapper.backward", _T + "training_step"),
             restored=False),
        Seam(_D + "DeepSpeedOptimizerWrapper.__has_overflow__", "writes",
             "DeepSpeed: the Trainer reads the engine optimizer's overflow (without ZeRO the "
             "guard gives the torch optimizer one after accelerate's prepare() looked)",
             (_D + "DeepSpeedOptimizerWrapper.__init__",
              _D + "DeepSpeedOptimizerWrapper.step_was_skipped")),
        Seam(_D + "DeepSpeedOptimizerWrapper.step_was_skipped", "follows",
             "DeepSpeed: a step the guard did not apply (DeepSpeed's overflow) holds the "
             "Trainer's LR schedule",
             (_D + "DeepSpeedOptimizerWrapper.step_was_skipped",
              "accelerate.accelerator.Accelerator.optimizer_step_was_skipped", _T + "_run_epoch"),
             restored=False),
    ],
    "lightning": [
        Seam(_L + "core.optimizer.LightningOptimizer._optimizer", "reads",
             "the guard behind the LightningOptimizer a hook is given",
             (_L + "core.optimizer.LightningOptimizer.__init__",), restored=False),
        Seam(_L + "strategies.strategy.Strategy.optimizers", "writes",
             "Lightning steps the guards (it wraps each in a LightningOptimizer)",
             (_L + "strategies.strategy.Strategy.setup_optimizers",
              _L + "core.optimizer.LightningOptimizer._to_lightning_optimizer",
              _L + "strategies.strategy.Strategy.optimizer_step")),
        Seam(_P + "precision.Precision._clip_gradients", "replaces",
             "the verdict after every on_before_optimizer_step (the LightningModule's own, run "
             "after the callbacks', included) and before the clip and the GradScaler's step",
             (_P + "precision.Precision._after_closure", _P + "precision.Precision._clip_gradients",
              _P + "amp.MixedPrecision.optimizer_step")),
        Seam(_P + "precision.Precision.clip_grad_by_norm", "replaces",
             "the clip by norm runs in the guarded step from the agreed norm, applied steps only",
             (_P + "precision.Precision.clip_gradients", _P + "precision.Precision.clip_grad_by_norm",
              _P + "precision.Precision._after_closure", _P + "amp.MixedPrecision.clip_gradients")),
        Seam(_P + "amp.MixedPrecision.optimizer_step", "replaces",
             "'16-mixed': the guard carries out a step the GradScaler left out",
             (_P + "amp.MixedPrecision.optimizer_step",
              _L + "loops.optimization.automatic._AutomaticOptimization._optimizer_step")),
        Seam(_L + "core.module.LightningModule.lr_scheduler_step", "replaces",
             "a step-interval scheduler holds on a step the guard did not apply",
             (_L + "core.module.LightningModule.lr_scheduler_step",
              _L + "loops.training_epoch_loop._TrainingEpochLoop._update_learning_rates")),
        Seam(_L + "trainer.trainer.Trainer._run", "follows",
             "the callback's saved state is loaded before on_fit_start (strategies that restore "
             "after setup, DeepSpeed's, ModelParallel's, FSDP's: before on_train_start)",
             (_L + "trainer.trainer.Trainer._run",), restored=False),
        Seam(_P + "deepspeed.DeepSpeedPrecision.optimizer_step", "follows",
             "DeepSpeed: Lightning's backward and step are the engine's, where the guard "
             "decides", (_P + "deepspeed.DeepSpeedPrecision.backward",
                         _P + "deepspeed.DeepSpeedPrecision.optimizer_step"), restored=False),
        Seam(_L + "strategies.deepspeed.DeepSpeedStrategy._initialize_deepspeed_train",
             "follows", "DeepSpeed: Lightning steps the LR schedulers (not the engine), so the "
             "callback holds them", (_L + "strategies.deepspeed.DeepSpeedStrategy."
                                     "_initialize_deepspeed_train",), restored=False),
    ],
}


if __name__ != "__main__":  # run as a program, the package's own module below is the one
    from . import _seams_deepspeed, _seams_megatron, _seams_torchtitan  # noqa: E402

    for _name, _table in (("deepspeed", _seams_deepspeed), ("megatron", _seams_megatron),
                          ("torchtitan", _seams_torchtitan)):
        TESTED_SOURCES[_name] = _table.TESTED
        SEAMS[_name] = _table.SEAMS


def _print_fingerprints(framework):
    """The fingerprints of the functions ``framework``'s seams rely on, as installed now: the
    entries a newly tested release adds to TESTED_SOURCES."""
    for path in TESTED_SOURCES[framework]:
        try:
            print("%s: %s" % (path, fingerprint(resolve(path))))
        except (ImportError, AttributeError, OSError, TypeError) as e:
            print("%s: missing (%s)" % (path, e))


if __name__ == "__main__":
    import sys
    from stepguard.integrations import _seams as tables  # with every framework's table
    for name in sys.argv[1:] or sorted(tables.TESTED_SOURCES):
        tables._print_fingerprints(name)

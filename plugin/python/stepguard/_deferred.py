"""The deferred verdict (``GuardedOptimizer(..., deferred=True)``): no host read in the step.

Each ``step()``:

1. decides the previous step from the host copy of its summed step buffer, which travelled
   while this step's forward and backward ran (the policy: rollback, LR, incidents, metrics,
   trace), and returns that step's report (None at the first step);
2. inspects this step and sums its buffer (the one collective, ordered on the device stream),
   and steps the wrapped optimizer with ``found_inf``, a device flag that is 1 when any rank's
   gradients or loss hold NaN/Inf or the optimizer state is bad: torch's fused optimizers then
   skip the update on the device, as under a GradScaler.

So skips of non-finite steps happen at their step; what needs the host (a rollback, an abort,
a lowered LR, an incident) happens one step late. A rollback restores its snapshot when the next
step begins, and that step's batch, whose backward ran on the abandoned weights, is dropped.

A framework integration drives the same halves itself (``resolve``, ``begin``, ``gated_apply``):
torchtitan's ``GuardedTrainer`` with ``StepguardConfig(deferred=True)``, whose port runs the
framework's own update over optimizers that each take the device flag (``gated_optimizers``).
"""

import torch

from ._port import is_zero_redundancy

# torch's optimizers whose fused step takes found_inf (and skips on it on the device).
_FUSED_FOUND_INF = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _takes_found_inf(optimizer):
    """Built with ``fused=True`` (torch then says so), or fused in every param group (as
    torchtitan builds its optimizers: the flag in each group, none to the constructor)."""
    if is_zero_redundancy(optimizer):
        return False
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return True
    groups = optimizer.param_groups
    return (isinstance(optimizer, _FUSED_FOUND_INF) and bool(groups)
            and all(g.get("fused") for g in groups))


def check_deferred(optimizer, port, grad_scaler, options):
    """Refuses, naming it, what the deferred verdict cannot serve; returns the torch optimizers
    whose update the device flag gates (the wrapped one, or those of a port that declares
    ``gated_optimizers``: a framework's update over torch optimizers)."""
    if port is None:
        gated = [optimizer]
    else:
        gated = list(getattr(port, "gated_optimizers", None) or [])
        if not gated:
            raise ValueError("stepguard: deferred=True steps a torch.optim optimizer through "
                             "GuardedOptimizer.step(); a framework's port runs its own update "
                             "(use the synchronous verdict there)")
    if grad_scaler is not None or options.loss_scaling:
        raise ValueError("stepguard: deferred=True with a loss scaler: the next step's scale "
                         "would depend on a decision not yet made; train in bf16 or fp32 with "
                         "deferred=True, or keep the synchronous verdict for fp16")
    for each in gated:
        if not _takes_found_inf(each):
            raise ValueError(
                "stepguard: deferred=True needs an optimizer that skips its update on a device "
                "flag (found_inf), as torch's fused optimizers do: torch.optim.Adam, AdamW, SGD "
                "or Adagrad with fused=True; %s does not take one" % type(each).__name__)
    return gated


def refuse_phases(what):
    raise RuntimeError("stepguard: %s of a guard built with deferred=True: its verdict is made "
                       "on the device and decided one step later inside step(); build the guard "
                       "without deferred for a framework that runs its own update" % what)


def resolve(guard, update_failed=False, batch_in_hand=False):
    """Decides the step waiting for its decision (its copy landed meanwhile); its report (after
    the guard's log and pictures), or None when none waits."""
    report = guard._guard.resolve_deferred(update_failed=update_failed,
                                           batch_in_hand=batch_in_hand)
    return None if report is None else guard._after_step(report)


def gated_apply(guard, found_inf, lr_factor, failed=None):
    """The port's update with ``found_inf`` handed to every gated optimizer (as GradScaler hands
    it) and the LR factor. When the update raises, the step is settled at once as not applied
    (counted, recorded; its report to ``failed``) and the error goes to the caller."""
    optimizers = guard._gated
    for each in optimizers:
        each.found_inf, each.grad_scale = found_inf, None
    try:
        guard._port.apply(lr_factor)
    except BaseException:
        report = resolve(guard, update_failed=True)
        if failed is not None:
            failed(report)
        raise
    finally:
        for each in optimizers:
            del each.found_inf, each.grad_scale


def deferred_step(guard, loss):
    """One deferred step (see the module's text); returns the previous step's report."""
    report = resolve(guard, batch_in_hand=True)
    if report is not None and (report.rolled_back or report.aborted):
        return report  # this batch is dropped (rollback) or training ends (abort)
    found_inf, lr_factor = guard._guard.begin_deferred(loss)
    gated_apply(guard, found_inf, lr_factor)
    return report


def flush(guard):
    """Decides the step still waiting for its decision (one host read); its report, or None."""
    return resolve(guard)

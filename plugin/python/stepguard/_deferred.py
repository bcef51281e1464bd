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
"""

from ._port import is_zero_redundancy


def check_deferred(optimizer, port, grad_scaler, options):
    """Refuses, naming it, what the deferred verdict cannot serve."""
    if port is not None:
        raise ValueError("stepguard: deferred=True steps a torch.optim optimizer through "
                         "GuardedOptimizer.step(); a framework's port runs its own update (use "
                         "the synchronous verdict there)")
    if grad_scaler is not None or options.loss_scaling:
        raise ValueError("stepguard: deferred=True with a loss scaler: the next step's scale "
                         "would depend on a decision not yet made; train in bf16 or fp32 with "
                         "deferred=True, or keep the synchronous verdict for fp16")
    if is_zero_redundancy(optimizer) or not getattr(optimizer, "_step_supports_amp_scaling",
                                                    False):
        raise ValueError(
            "stepguard: deferred=True needs an optimizer that skips its update on a device flag "
            "(found_inf), as torch's fused optimizers do: torch.optim.Adam, AdamW, SGD or "
            "Adagrad with fused=True; %s does not take one" % type(optimizer).__name__)


def refuse_phases(what):
    raise RuntimeError("stepguard: %s of a guard built with deferred=True: its verdict is made "
                       "on the device and decided one step later inside step(); build the guard "
                       "without deferred for a framework that runs its own update" % what)


def deferred_step(guard, loss):
    """One deferred step (see the module's text); returns the previous step's report."""
    engine = guard._guard
    report = engine.resolve_deferred(batch_in_hand=True)
    if report is not None:
        guard._after_step(report)
        if report.rolled_back or report.aborted:
            return report  # this batch is dropped (rollback) or training ends (abort)
    found_inf, lr_factor = engine.begin_deferred(loss)
    optimizer = guard.optimizer
    optimizer.found_inf, optimizer.grad_scale = found_inf, None
    try:
        guard._port.apply(lr_factor)
    except BaseException:
        # Settled at once as not applied (counted, recorded); the error goes to the caller.
        failed = engine.resolve_deferred(update_failed=True)
        if failed is not None:
            guard._after_step(failed)
        raise
    finally:
        del optimizer.found_inf, optimizer.grad_scale
    return report


def flush(guard):
    """Decides the step still waiting for its decision (one host read); its report, or None."""
    report = guard._guard.resolve_deferred()
    return None if report is None else guard._after_step(report)


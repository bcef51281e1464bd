"""torch.amp.GradScaler and the guard: what a guard needs of the scaler that owns the loss scale,
whether the scaler steps the guard (``GuardedOptimizer(..., grad_scaler=scaler)``: PyTorch's own
fp16 recipe) or a framework steps it (Lightning's '16-mixed', HF's ``fp16=True``).

The scaler keeps its rules (growth, backoff, no floor of its own); the guard judges the
gradients the scaler unscaled (``unscale_`` runs once per step, as GradScaler runs it), with the
scale this step's backward used, and makes an overflow that any rank saw an overflow on every
rank's scaler, so that the ranks' scales never part. The GradScaler attributes beyond its public
methods that this relies on are declared in ``integrations._seams`` (framework "torch")."""

import torch

from ._port import TorchOptimPort

__all__ = ["GRAD_SCALER_FLOOR", "ScalerPort", "check_grad_scaler", "scaler_unscaled",
           "unscale_once", "scaled_loss_unscaled", "agree_overflow"]

#: torch's GradScaler halves its scale on every overflow with no floor of its own; at or below
#: this scale the guard takes an overflow for one the scale cannot fix (fp16 gradients beyond
#: 65504 unscaled) and escalates by the policy, as at DeepSpeed's and Megatron's min_scale.
GRAD_SCALER_FLOOR = 1.0


def check_grad_scaler(scaler, where="grad_scaler"):
    """Refuses anything but a ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` is one):
    the guard follows that class's rules and state."""
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError("stepguard: %s must be a torch.amp.GradScaler (its rules and state are "
                        "the ones the guard follows), got %s" % (where, type(scaler).__name__))


class ScalerPort(TorchOptimPort):
    """A torch optimizer whose loss scale a ``torch.amp.GradScaler`` owns: the guard scales
    nothing of its own (a policy's ``loss_scale`` section is the scaler's). The scaler's
    ``unscale_`` has run when the guard reads the gradients, so they arrive unscaled; the scale
    given to the guard is the one this step's backward used (the scaler's ``update()`` comes
    after the step). No scaler (bf16, fp32), or one built with ``enabled=False``: no scale."""

    def __init__(self, optimizer, named_parameters, scaler=None, layout=None):
        super().__init__(optimizer, named_parameters, layout=layout)
        self.scaler = scaler
        self.held_scale = None  # hold_scale()'s copy, for a verdict taken after update()

    def hold_scale(self):
        """Keeps this step's scale (a device copy, no host read) for a verdict that may come
        after the scaler's ``update()`` (which changes the scale in place): the HF Trainer's,
        taken after its callbacks, on a step the scaler left out."""
        if self.scaler is not None and self.scaler.is_enabled():
            self.held_scale = self.scaler._get_scale_async().clone()

    def framework_loss_scale(self):
        """The scale as the scaler's own device tensor: it rides in the step buffer and reaches
        the host with the step's one read (``get_scale()`` would be a read of its own)."""
        held, self.held_scale = self.held_scale, None
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        scale = held if held is not None else self.scaler._get_scale_async()
        return scale, GRAD_SCALER_FLOOR, False


def _state(scaler, optimizer):
    # GradScaler's record of this optimizer in this step (declared seam: torch's
    # GradScaler._per_optimizer_states).
    return scaler._per_optimizer_states[id(optimizer)]


def scaler_unscaled(scaler, optimizer):
    """Whether ``scaler.unscale_(optimizer)`` ran since the scaler's last ``update()`` (torch
    refuses a second call)."""
    from torch.amp.grad_scaler import OptState
    return _state(scaler, optimizer)["stage"] is not OptState.READY


def unscale_once(scaler, optimizer):
    """``scaler.unscale_(optimizer)`` unless it ran already this step (the user's clip, or a
    framework's, may have called it)."""
    if not scaler_unscaled(scaler, optimizer):
        scaler.unscale_(optimizer)


def scaled_loss_unscaled(loss, scaler):
    """``loss`` as the step's loss for the guard: divided by ``scaler``'s scale when the
    framework hands over the loss it scaled for backward (Lightning's on_before_backward)."""
    if scaler is None or not scaler.is_enabled():
        return loss
    # The scale as the scaler's own device tensor: no read to the host per micro-batch.
    return loss.detach().float() / scaler._get_scale_async().float()


def agree_overflow(scaler, optimizer, nonfinite_count):
    """After the verdict: when the gradients of any rank held Inf or NaN (``nonfinite_count``,
    agreed across ranks), this rank's scaler records an overflow too, so that its ``update()``
    backs off as every other rank's does (a fault on one rank alone would otherwise leave the
    ranks' scales, and with them their gradients, apart). Device writes only."""
    if nonfinite_count <= 0 or scaler is None or not scaler.is_enabled():
        return
    for found_inf in _state(scaler, optimizer)["found_inf_per_device"].values():
        found_inf.fill_(1.0)

"""The clips a guard drives inside a framework, from the host: the framework's clip given the
agreed norm, the policy's clip after a framework's own, and the norm tensors a framework's code
takes, filled in place. No tensor is made and nothing is copied to the device per step."""

import math
import struct

import torch


def _fp32(value):
    """``value`` rounded to the nearest fp32 (inf past fp32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def clip_to(grads, max_norm, norm):
    """Clips ``grads`` (gradient tensors) to ``max_norm`` given their norm as a host float, as
    ``torch.nn.utils.clip_grads_with_norm_(..., max_norm, torch.tensor(norm))`` does to the last
    bit (its fp32 coefficient ``max_norm / (norm + 1e-6)`` clamped at 1), without making a tensor
    or copying one to the device: one foreach multiply by a host scalar for the fp32 and fp64
    gradients, nothing when the coefficient is 1. bf16 and fp16 gradients are multiplied one by
    one (``mul_`` by the scalar): torch's foreach multiply by a scalar rounds the factor to
    their precision, which its clip (a 0-d fp32 factor) does not."""
    coefficient = min(1.0, _fp32(_fp32(1.0 / _fp32(_fp32(norm) + _fp32(1e-6)))
                                 * _fp32(max_norm)))
    if not coefficient < 1.0:  # (1: nothing to do; NaN: a norm the callers never pass)
        return
    wide = [g for g in grads if g.dtype in (torch.float32, torch.float64)]
    if wide:
        torch._foreach_mul_(wide, coefficient)
    for g in grads:
        if g.dtype not in (torch.float32, torch.float64):
            g.mul_(coefficient)


class HostValue:
    """A value the host knows, handed to framework code that wants a 0-d device tensor: one
    tensor made at the first use and filled each step (``of(value)``: a fill kernel with the
    value as its argument, no copy from host memory and no tensor made per step). The framework
    code must be done with the last step's value before the next ``of``."""

    def __init__(self, device, dtype=torch.float32):
        self.device, self.dtype = device, dtype
        self._tensor = None

    def of(self, value):
        if self._tensor is None:
            self._tensor = torch.empty((), dtype=self.dtype, device=self.device)
        return self._tensor.fill_(value)


def clip_with_verdict(parameters, max_norm, verdict):
    """The framework's gradient clip to ``max_norm`` (and the policy's clip, when it clipped this
    step) by one factor, from the norm the guard agreed (``verdict.grad_norm``): the norm is not
    computed a second time, and the factor comes from the host (``clip_to``). Nothing when
    neither clips or the norm is not finite."""
    targets = [t for t in (max_norm, verdict.clip_norm) if t is not None and t > 0.0]
    norm = verdict.grad_norm
    if not targets or not math.isfinite(norm):
        return
    clip_to([p.grad for p in parameters if p.grad is not None], min(targets), norm)


def policy_clip_after(parameters, max_norm, verdict):
    """With ``framework_norm``: the framework clipped to ``max_norm`` with its own norm; the
    policy's clip (``verdict.clip_norm``) on top, from the norm that clip left (the agreed norm
    brought to ``max_norm``). Nothing when the policy did not clip or the norm is not finite."""
    norm = verdict.grad_norm
    if not verdict.applies or verdict.clip_norm is None or not math.isfinite(norm):
        return
    if max_norm and max_norm > 0:
        norm = norm * min(1.0, max_norm / (norm + 1e-6))
    if norm > verdict.clip_norm:
        clip_to([p.grad for p in parameters if p.grad is not None], verdict.clip_norm, norm)

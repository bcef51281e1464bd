"""The checks a GuardedOptimizer makes when it is built, and the hook tables it sets up: kept
apart from the guard's step (stepguard/_guard.py)."""

import difflib
from collections import OrderedDict

import torch

from . import _C, _amp


def init_hook_tables(optimizer):
    """The hook tables torch.optim.Optimizer.__init__ creates, under the names its public
    registrars (``register_step_pre_hook`` and the rest) and ``profile_hook_step`` use."""
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                 "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                 "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
        setattr(optimizer, name, OrderedDict())


def checked_scaler(scaler, port, options, allow_untested=False):
    if scaler is None:
        return None
    _amp.check_grad_scaler(scaler)
    if port is not None:
        raise ValueError("stepguard: give grad_scaler to the guard or a port, not both (the "
                         "port then owns the loss scale)")
    if options.loss_scaling:
        raise ValueError("stepguard: loss_scaling=True and grad_scaler: two owners of one loss "
                         "scale; keep the GradScaler (the guard follows its scale) or the "
                         "guard's own scaling (guard.scale_loss), not both")
    from .integrations._seams import check_seams
    check_seams("torch", allow_untested)
    return scaler


def check_default_group(process_group):
    """With torch.distributed running on several ranks, a guard without a group would decide on
    each rank alone: one rank skips a NaN step the others apply, and the replicas part silently."""
    if process_group is not None or not torch.distributed.is_available():
        return
    if not torch.distributed.is_initialized():
        return
    world = torch.distributed.get_world_size()
    if world > 1:
        raise ValueError(
            "stepguard: torch.distributed runs %d ranks but the guard was given no "
            "process_group, so each rank would decide alone (a step skipped on one rank and "
            "applied on another parts the replicas); pass process_group=dist.group.WORLD (or the "
            "group the gradients are averaged over)" % world)


def check_zero_group(optimizer, process_group):
    """A ZeRO optimizer steps collectively: every rank of its group must take the same decision,
    so the guard must agree across at least those ranks."""
    if optimizer.world_size == 1:
        return
    if process_group is None:
        raise ValueError(
            "stepguard: this ZeroRedundancyOptimizer shards its state over %d ranks; give the "
            "guard process_group= (its group, e.g. dist.group.WORLD) so that every rank takes the "
            "same decision (a step skipped on one rank only would leave the others waiting in "
            "its parameter broadcast)" % optimizer.world_size)
    size = process_group.size()
    if size < optimizer.world_size:
        raise ValueError(
            "stepguard: the guard's process_group has %d ranks, fewer than the %d this "
            "ZeroRedundancyOptimizer shards its state over; give it the optimizer's group or one "
            "that contains it" % (size, optimizer.world_size))


def guard_options_of(policy, policy_yaml, process_group, store, options):
    """One ``_C.GuardOptions`` from the keywords: the names and types are the C++ struct's."""
    unknown = sorted(set(options) - set(_C.GuardOptions.fields))
    if unknown:
        near = difflib.get_close_matches(unknown[0], _C.GuardOptions.fields, n=1)
        raise TypeError("stepguard: unknown option %s%s (known: %s)"
                        % (", ".join(unknown), " (did you mean %s?)" % near[0] if near else "",
                           ", ".join(_C.GuardOptions.fields)))
    out = _C.GuardOptions()
    named = dict(policy=policy, policy_yaml=policy_yaml, process_group=process_group, store=store)
    for name, value in named.items():
        if value is not None:  # None: not given
            setattr(out, name, value)
    for name, value in options.items():  # a keyword given is a value, None included
        setattr(out, name, value)
    return out


def with_module_probes(fn, model, guard):
    if not isinstance(model, torch.nn.Module):
        raise TypeError("stepguard: set_replay(model=...) takes a torch.nn.Module, got %s"
                        % type(model).__name__)
    # Names as the parameters have them: a wrapper's own prefix (DDP's "module.") is dropped.
    inner = getattr(model, "module", model) if isinstance(
        getattr(model, "module", None), torch.nn.Module) else model
    modules = [(name, m) for name, m in inner.named_modules() if name]

    def probe_output(name):
        def hook(_module, _inputs, output):
            if torch.is_tensor(output) and output.is_floating_point():
                return guard.probe(name, output)
            if isinstance(output, tuple) and output and torch.is_tensor(output[0]) \
                    and output[0].is_floating_point():
                return (guard.probe(name, output[0]),) + output[1:]
            return None
        return hook

    def replay(mode):
        handles = [m.register_forward_hook(probe_output(name)) for name, m in modules]
        try:
            return fn(mode)
        finally:
            for h in handles:
                h.remove()
    return replay

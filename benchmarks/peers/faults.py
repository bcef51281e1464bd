"""The fault matrix, the same for every tool, and the coverage loop that runs one tool through
one fault: which step caught it, what the tool did, and whether the ranks stayed equal."""

import torch

from .common import batch, build_model, replicas_equal
from .tools import Aborted

# Steps of the full run (the issue's): spikes at 20 (before most warm-ups) and 300, the LR x100
# from 200; the NaN/Inf faults and the corruption sit between them. --smoke scales them down.
FULL = dict(steps=350, nan_grad=150, inf_loss=160, bf16_nan=170, spike_early=20,
            spike_late=300, divergence=200, corruption=250)
SMOKE = dict(steps=24, nan_grad=8, inf_loss=9, bf16_nan=10, spike_early=3, spike_late=20,
             divergence=14, corruption=12)
TARGET = "net.head.weight"  # the parameter a gradient fault or a corruption hits


class Fault:
    """One fault: ``at`` is its step; ``rank_only`` says it happens on the last rank alone."""

    def __init__(self, name, at, precision="fp32", rank_only=False):
        self.name, self.at, self.precision, self.rank_only = name, at, precision, rank_only

    def hits(self, step, rank, world):
        return step == self.at and (not self.rank_only or rank == world - 1)

    def loss_factor(self, step, rank, world):
        return 1.0

    def grad_hook(self, step, rank, world):
        return None

    def before(self, step, rank, world, tool, target):
        pass


class NanGrad(Fault):
    def grad_hook(self, step, rank, world):
        if not self.hits(step, rank, world):
            return None
        if self.precision == "bf16":  # one element of a bf16 gradient
            def one(g):
                g = g.clone()
                g.view(-1)[0] = float("nan")
                return g
            return one
        return lambda g: g * float("nan")


class LossFactor(Fault):
    def __init__(self, name, at, factor, **kw):
        super().__init__(name, at, **kw)
        self.factor = factor

    def loss_factor(self, step, rank, world):
        return self.factor if self.hits(step, rank, world) else 1.0


class Divergence(Fault):
    def before(self, step, rank, world, tool, target):
        if step == self.at:
            for group in tool.param_groups():
                group["lr"] *= 100


class Corruption(Fault):
    def before(self, step, rank, world, tool, target):
        if self.hits(step, rank, world):
            with torch.no_grad():
                target.mul_(1.5)  # finite, plausible values: no NaN/Inf check sees it


def matrix(s):
    return [NanGrad("nan_grad_one_rank", s["nan_grad"], rank_only=True),
            LossFactor("inf_loss", s["inf_loss"], float("inf"), rank_only=True),
            NanGrad("bf16_nan", s["bf16_nan"], precision="bf16", rank_only=True),
            LossFactor("spike_10x_early", s["spike_early"], 10.0),
            LossFactor("spike_10x_late", s["spike_late"], 10.0),
            Divergence("divergence_lr_x100", s["divergence"]),
            Corruption("weight_corruption_one_replica", s["corruption"], rank_only=True)]


def run_fault(tool_class, fault, size, steps, rank, world, group):
    """One fresh model and tool through ``steps`` steps with ``fault``; every rank returns the
    same record except ``ranks_equal`` bookkeeping, which is gathered."""
    model = build_model(size, fault.precision)
    tool = tool_class(model, fault.precision, world, group, True, batch(size, 0, 0)[0].shape[0])
    target = dict(model.named_parameters())[TARGET]
    record = {"caught_step": None, "actions": [], "false_alarms": 0, "aborted_at": None,
              "ranks_equal_always": True}
    for step in range(1, steps + 1):
        fault.before(step, rank, world, tool, target)
        hook_fn = fault.grad_hook(step, rank, world)
        hook = target.register_hook(hook_fn) if hook_fn else None
        x, y = batch(size, step, rank)
        try:
            action = tool.iteration(x, y, fault.loss_factor(step, rank, world))
        except Aborted as e:
            action, record["aborted_at"], record["abort_reason"] = "abort", step, str(e)[:200]
        finally:
            if hook is not None:
                hook.remove()
        if action != "nothing":
            if step < fault.at:
                record["false_alarms"] += 1
            else:
                record["caught_step"] = record["caught_step"] or step
                if action not in record["actions"]:
                    record["actions"].append(action)
        if action == "abort":
            break
        if step >= fault.at:
            equal, _ = replicas_equal(tool.params, world)
            record["ranks_equal_always"] &= equal
    equal, finite = replicas_equal(tool.params, world)
    record.update(ranks_equal_end=equal, finite_end=finite, steps_run=step, fault_step=fault.at,
                  precision=fault.precision)
    return record

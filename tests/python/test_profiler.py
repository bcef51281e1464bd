"""The guard's stages are named ranges in torch.profiler traces (stepguard::verdict, ::inspect,
::agree, ::decide, ::settle, ::act, ::snapshot, ::snapshot_wait, ::record; ::restore on a
rollback, ::forensics on an incident), under GuardedOptimizer.step() and under the two-phase
verdict()/settle() every framework integration calls."""

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import stepguard

POLICY = """version: 1
checkpoint: {snapshot_every: 2}
detectors: {loss_spike: {warmup: 2, recent_factor: 0}}
rules:
  - {on: loss_spike, action: rollback}
"""


def _guard():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, stepguard.GuardedOptimizer(opt, model.named_parameters(), policy_yaml=POLICY)


def _loss(model, step):
    x = torch.ones(8, 4) * (1 + step % 3)
    return model(x).pow(2).mean() * (1000.0 if step == 6 else 1.0)


def _names(prof):
    return {e.name for e in prof.events() if e.name.startswith("stepguard::")}


def test_a_guarded_step_shows_its_stages_in_the_profiler():
    model, guard = _guard()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(1, 8):
            guard.zero_grad()
            loss = _loss(model, step)
            loss.backward()
            report = guard.step(loss.detach())
    names = _names(prof)
    assert {"stepguard::verdict", "stepguard::inspect", "stepguard::agree", "stepguard::decide",
            "stepguard::settle", "stepguard::act", "stepguard::snapshot",
            "stepguard::snapshot_wait", "stepguard::record", "stepguard::restore",
            "stepguard::forensics"} <= names, names
    assert report.step == 7


def test_the_two_phases_frameworks_call_show_the_same_stages():
    model, guard = _guard()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(1, 4):
            guard.zero_grad()
            loss = _loss(model, step)
            loss.backward()
            verdict = guard.verdict(loss.detach())
            if verdict.applies:
                guard.optimizer.step()
            guard.settle(verdict, verdict.applies)
    assert {"stepguard::verdict", "stepguard::inspect", "stepguard::agree", "stepguard::decide",
            "stepguard::settle", "stepguard::record"} <= _names(prof)
    assert guard.stats().step_count == 3


def _guard_allocations(width):
    """Bytes allocated (and not freed within their own op) inside the guard's stages during one
    steady-state step of the default policy (state check on, no snapshot due), by op and stage;
    the wrapped optimizer's own step is left out (torch.optim allocates for its update)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8))
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters()),
                                       model.named_parameters(), policy="default")

    def loss():
        guard.zero_grad()
        out = model(torch.ones(4, width)).pow(2).mean()
        out.backward()
        return out
    for _ in range(5):  # the step buffer, the host staging and the state are made by now
        guard.step(loss())
    step_loss = loss()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        guard.step(step_loss)
    found = {}
    for e in prof.events():
        scopes, p = [], e
        while p is not None:
            scopes.append(p.name)
            p = p.cpu_parent
        stages = [s for s in scopes if s.startswith("stepguard::")]
        theirs = any(s.startswith("Optimizer.step#") and "GuardedOptimizer" not in s
                     for s in scopes)
        if stages and not theirs and e.self_cpu_memory_usage > 0:
            key = "%s in %s" % (e.name, stages[0])
            found[key] = found.get(key, 0) + e.self_cpu_memory_usage
    return found


def test_a_steady_state_step_allocates_scalars_only_whatever_the_model():
    # profile_memory: the guard's own allocations in a step are a few 0-d temporaries (the loss
    # and the flags packed into the step buffer), the same for a model of about 15x the parameters:
    # no buffer, copy or per-tensor list is made per step.
    small, large = _guard_allocations(64), _guard_allocations(256)
    assert small == large, (small, large)
    assert 0 < sum(small.values()) <= 256, small
    assert all(size <= 64 for size in small.values()), small

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

"""Cost: a tool's training iteration against the plain one (torch.optim.AdamW, the same gradient
average), alternating blocks in one process, medians of each, as bench_python_step does; and the
tool's own check time per step."""

import statistics
import time

import torch

from .common import average_gradients, batch, build_model, loss_of
from .tools import LR, WEIGHT_DECAY


def _plain(model, world):
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)

    def iteration(x, y):
        loss_of(model(x), y).backward()
        average_gradients(params, world)
        optimizer.step()
        optimizer.zero_grad()
    return iteration


def measure(tool_class, size, precision, rank, world, group, rounds, block):
    """Returns plain and guarded medians (ms), the overhead and the tool's check time."""
    model = build_model(size, precision)
    # An engine that takes over the gradients (hooks, buffers) trains a copy with the same seed.
    tool_model = build_model(size, precision) if tool_class.own_model else model
    x, y = batch(size, 1, rank)
    tool = tool_class(tool_model, precision, world, group, False, x.shape[0])
    plain = _plain(model, world)

    def guarded(x, y):
        tool.iteration(x, y, 1.0)
        checks.append(tool.check_seconds)

    plain_times, guarded_times, checks = [], [], []
    plain(x, y)  # warm-up, not timed
    guarded(x, y)
    checks.clear()
    for r in range(rounds):
        for run, times in ((plain, plain_times), (guarded, guarded_times)):
            for i in range(block):
                xb, yb = batch(size, 2 + r * block + i, rank)
                t0 = time.perf_counter()
                run(xb, yb)
                times.append(time.perf_counter() - t0)
    plain_ms = statistics.median(plain_times) * 1e3
    guarded_ms = statistics.median(guarded_times) * 1e3
    return {"plain_ms": round(plain_ms, 3), "guarded_ms": round(guarded_ms, 3),
            "overhead": round(guarded_ms / plain_ms - 1, 4),
            "check_ms": round(statistics.median(checks) * 1e3, 4),
            "check_share": round(statistics.median(checks) * 1e3 / plain_ms, 4),
            "iterations": len(guarded_times),
            "baseline_model": "a copy (same seed)" if tool_class.own_model else "the same model"}

#!/usr/bin/env python3
"""A Python training iteration with guard.step(loss) against the same iteration with
optimizer.step(), in one process, interleaved in blocks, medians of each.

    PYTHONPATH=build/python .venv/bin/python benchmarks/bench_python_step.py [--rounds R] [--block B]

Cases: the demo's character transformer (0.4M parameters) and one of ~50M parameters (d_model 768,
7 blocks, batch 8 x 128 tokens), each with the default policy (RAM snapshots every 50 steps: run
at least 50 guarded iterations to include them; the mean counts them, the median does not) and
with snapshots off. Both variants train one model (two AdamW instances over its parameters), in
alternating blocks. Prints one JSON object per case: case, params, plain_ms, guarded_ms,
overhead (= guarded / plain - 1, medians), and the same from means (overhead_mean).

--fused: each case twice over fused AdamW (plain and guarded alike): with the synchronous verdict
("<case>/fused") and with deferred=True ("<case>/deferred"), whose step has no host read.
"""

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration", "pytorch"))
import stepguard  # noqa: E402
from train_gpt import CharTransformer  # noqa: E402

DEFAULT_POLICY = os.path.join(HERE, "..", "configs", "policies", "default.yaml")
# The default policy's detectors and rules without the ones that need snapshots (rollbacks).
NO_SNAPSHOTS = """version: 1
detectors:
  loss_spike: {z: 6, warmup: 100, decay: 0.99}
  grad_norm_spike: {z: 6, warmup: 100, decay: 0.99}
rules:
  - {name: skip-nonfinite, on: nonfinite, action: skip_batch}
  - {name: cool-down-lr, on: nonfinite, consecutive: 3, action: lower_lr, factor: 0.5}
  - {name: skip-loss-spike, on: loss_spike, action: skip_batch}
  - {name: clip-grad-norm-spike, on: grad_norm_spike, action: clip}
limits:
  max_consecutive_bad_steps: 50
"""


def run_case(name, config, batch, context, policy_yaml, rounds, block, fused=False,
             deferred=False):
    vocab = 96
    torch.manual_seed(0)
    # One model, two optimizers over its parameters: the iterations differ only in their step
    # (two model copies measured a memory-placement difference of up to 17% instead).
    model = CharTransformer(vocab, context=context, **config)
    plain_model = guarded_model = model
    plain_opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)
    guard = stepguard.GuardedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None),
        model.named_parameters(), policy_yaml=policy_yaml, deferred=deferred)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (batch, context), generator=g)
    y = torch.randint(0, vocab, (batch, context), generator=g)

    def iteration(model, step):
        logits = model(model.embed(x))
        loss = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1))
        loss.backward()
        step(loss)

    def plain_step(loss):
        plain_opt.step()
        plain_opt.zero_grad()

    def guarded_step(loss):
        guard.step(loss.detach())
        guard.zero_grad()

    plain_times, guarded_times = [], []
    iteration(plain_model, plain_step)  # warm-up, not timed
    iteration(guarded_model, guarded_step)
    for _ in range(rounds):
        for model, step, times in ((plain_model, plain_step, plain_times),
                                   (guarded_model, guarded_step, guarded_times)):
            for _ in range(block):
                t0 = time.perf_counter()
                iteration(model, step)
                times.append(time.perf_counter() - t0)
    plain_ms = statistics.median(plain_times) * 1e3
    guarded_ms = statistics.median(guarded_times) * 1e3
    # The mean includes the snapshot steps the median hides: report both.
    plain_mean = statistics.mean(plain_times) * 1e3
    guarded_mean = statistics.mean(guarded_times) * 1e3
    return {
        "case": name,
        "params": sum(p.numel() for p in plain_model.parameters()),
        "plain_ms": round(plain_ms, 3), "guarded_ms": round(guarded_ms, 3),
        "overhead": round(guarded_ms / plain_ms - 1, 4),
        "plain_mean_ms": round(plain_mean, 3), "guarded_mean_ms": round(guarded_mean, 3),
        "overhead_mean": round(guarded_mean / plain_mean - 1, 4),
        "guarded_iterations": len(guarded_times) + 1, "snapshots": guard.stats().totals.snapshots,
    }


def steady_host_memory():
    """Pins glibc's allocation thresholds, as bench_step does: with its moving defaults, AdamW's
    per-step temporaries are sometimes mapped fresh and fault their pages in again, in the plain
    and the guarded loop alike (hundreds of ms a step on a 50M model here), which a GPU job's
    caching allocator never sees."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to pin
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def main():
    steady_host_memory()
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--only", default="", help="run only cases whose name contains this")
    p.add_argument("--fused", action="store_true",
                   help="fused AdamW, each case with the synchronous and the deferred verdict")
    p.add_argument("--large-rounds", type=int, default=0,
                   help="rounds for the 50M cases (default: --rounds)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    demo = dict(d_model=128, heads=4, layers=2)
    large = dict(d_model=768, heads=12, layers=7)
    policy = open(DEFAULT_POLICY).read()
    cases = [
        ("demo/default_policy", demo, 32, 64, policy),
        ("demo/no_snapshots", demo, 32, 64, NO_SNAPSHOTS),
        ("50M/default_policy", large, 8, 128, policy),
        ("50M/no_snapshots", large, 8, 128, NO_SNAPSHOTS),
    ]
    for name, config, batch, context, policy_yaml in cases:
        if args.only and args.only not in name:
            continue
        rounds = args.large_rounds if args.large_rounds and "50M" in name else args.rounds
        variants = [(name + "/fused", True, False), (name + "/deferred", True, True)] \
            if args.fused else [(name, False, False)]
        for label, fused, deferred in variants:
            print(json.dumps(run_case(label, config, batch, context, policy_yaml, rounds,
                                      args.block, fused, deferred)), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The guarded DeepSpeed optimizer step against DeepSpeed's own, on CPU with Gloo.

    PYTHONPATH=build/python OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu \
        .venv/bin/python benchmarks/bench_deepspeed_step.py [--ranks 1] [--rounds 5 --block 4]
        [--width 1024 --depth 8] [--json OUT.json] [--smoke] [--require-once]

For each configuration (ZeRO 0 and 2, fp32 and bf16, gradient clipping 1.0 as DeepSpeed users
set it) two engines over the same model shape, one plain and one with
``stepguard.integrations.deepspeed.guard_engine(engine, policy="default")``, run in alternating
blocks in one process. Timed: ``engine.step()`` at the accumulation boundary (where DeepSpeed runs
its optimizer step; forward and backward are not timed), median over the blocks' iterations;
ratio = guarded / plain. The plain step computes its norm (and, in bf16 ZeRO, its overflow check)
itself; the guarded one inspects every gradient once, agrees in one collective and hands DeepSpeed
that norm (bf16 ZeRO 0: DeepSpeed's own step, which computes its own norm as unguarded). Also counted over one engine.step() of each: all-reduces through torch.distributed
(the guard's own collective is not one: it runs in C++) and calls of DeepSpeed's and torch's
gradient-norm functions.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

# Configurations whose guarded step is DeepSpeed's own step with its own norm (bf16 without
# ZeRO: FP16_Optimizer; handing it the agreed norm would need a copy of its step).
OWN_NORM = ("0-bf16",)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "frameworks"))

CONFIGS = [(0, "fp32"), (0, "bf16"), (2, "fp32"), (2, "bf16")]


def _model(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def _engine(stage, precision, width, depth, guarded):
    import deepspeed
    import stepguard.integrations.deepspeed as sg_deepspeed

    model = _model(width, depth)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9,
              "bf16": {"enabled": precision == "bf16"}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    guard = sg_deepspeed.guard_engine(engine, policy="default") if guarded else None
    return engine, guard


def _timed_step(engine, width, precision, seed):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, width, generator=g).to(dtype)
    y = torch.randn(8, 8, generator=g)
    engine.backward(nn.functional.mse_loss(engine(x).float(), y))
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _counted_step(engine, width, precision):
    """engine.step() of one more step, counting over all of it: all-reduces through
    torch.distributed and calls of DeepSpeed's and torch's gradient-norm functions."""
    from conftest import counted_calls, deepspeed_step_counters

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    x = torch.randn(8, width).to(dtype)
    engine.backward(nn.functional.mse_loss(engine(x).float(), torch.randn(8, 8)))
    with counted_calls(deepspeed_step_counters()) as counts:
        engine.step()
    return dict(counts)


def measure(stage, precision, args):
    plain, _ = _engine(stage, precision, args.width, args.depth, False)
    guarded, guard = _engine(stage, precision, args.width, args.depth, True)
    times = {"plain": [], "guarded": []}
    seed = 0
    for _ in range(2):  # warm-up
        for kind, engine in (("plain", plain), ("guarded", guarded)):
            _timed_step(engine, args.width, precision, seed)
            seed += 1
    for _ in range(args.rounds):
        for kind, engine in (("plain", plain), ("guarded", guarded)):
            for _ in range(args.block):
                times[kind].append(_timed_step(engine, args.width, precision, seed))
                seed += 1
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["ratio"] = out["guarded"] / out["plain"]
    out["counts_plain"] = _counted_step(plain, args.width, precision)
    out["counts_guarded"] = _counted_step(guarded, args.width, precision)
    out["outcomes"] = guard.guard.stats().totals.to_dict()
    return out


def _rank_main(rank, world, port, out_dir, args):
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    results = {"%d-%s" % c: measure(*c, args) for c in CONFIGS}
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="alternating blocks (default 5)")
    parser.add_argument("--block", type=int, default=4, help="steps per block (default 4)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (default 1024)")
    parser.add_argument("--depth", type=int, default=8, help="hidden layers (default 8)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 1 round of 1")
    parser.add_argument("--require-once", action="store_true",
                        help="exit 2 unless every guarded step made no all-reduce and no norm of "
                             "DeepSpeed's or torch's (the guard's own collective aside)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.block, args.width, args.depth = 1, 1, 32, 1
    from conftest import spawn_ranks

    ranks = spawn_ranks(_rank_main, args.ranks, args, timeout=3600)
    params = sum(p.numel() for p in _model(args.width, args.depth).parameters())
    print("DeepSpeed's optimizer step, %.1fM parameters, %d rank(s), ms (medians of %d):"
          % (params / 1e6, args.ranks, args.rounds * args.block))
    print("| ZeRO | grads | DeepSpeed ms | guarded ms | ratio | all-reduces (plain / guarded) "
          "| norm calls (plain / guarded) |")
    print("|---|---|---|---|---|---|---|")
    for key, r in ranks[0].items():
        stage, precision = key.split("-")
        print("| %s | %s | %.1f | %.1f | %.2f | %d / %d | %d / %d |"
              % (stage, precision, r["plain"], r["guarded"], r["ratio"],
                 r["counts_plain"]["all_reduce"], r["counts_guarded"]["all_reduce"],
                 r["counts_plain"]["norms"], r["counts_guarded"]["norms"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"parameters": params, "ranks": ranks, "args": vars(args)}, f, indent=1)
    if args.require_once:
        # bf16 ZeRO 0 (FP16_Optimizer: DeepSpeed's own step) pays DeepSpeed's norm: no more than
        # the plain step's; every other guarded step makes neither.
        def extra_calls(key, r):
            if key in OWN_NORM:
                return any(r["counts_guarded"][k] > r["counts_plain"][k]
                           for k in ("all_reduce", "norms"))
            return r["counts_guarded"]["all_reduce"] or r["counts_guarded"]["norms"]
        extra = ["rank %d %s: %s" % (rank, key, r["counts_guarded"])
                 for rank, results in enumerate(ranks) for key, r in results.items()
                 if extra_calls(key, r)]
        if extra:
            print("not once: " + "; ".join(extra), file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""stepguard against the tools a user would pick instead, each through its own code: torch's
GradScaler, OLMo-core's SkipStepAdamW, DeepSpeed's engine (ZeRO 1) and Megatron-core's DDP and
optimizer (benchmarks/peers/tools.py says exactly what each runs), on CPU with Gloo.

    PYTHONPATH=build/python .venv/bin/python benchmarks/bench_peers.py [--json OUT.json]
        [--ranks 1,2] [--rounds R --block B] [--smoke]

1. Cost: the 50M transformer of bench_python_step (d 768, 7 blocks, batch 8 x 128), AdamW, fp32
   and bf16, on 1 and 2 ranks: each tool's iteration against the plain AdamW iteration in
   alternating blocks in one process (medians), and the tool's own check time per step.
2. Coverage: every tool through the same loop and fault matrix (peers/faults.py) on a small
   configuration of the same model (d 32, 1 block, batch 4 x 16: 350 steps x 7 faults x 5 tools
   must fit in minutes on CPU): the step that caught each fault, what the tool did, whether the
   ranks stayed equal.
Prints the Markdown tables and writes one JSON (--json). --smoke: a few iterations per tool and a
24-step fault schedule (the fault steps scaled down), to check that the benchmark runs.
--coverage-only: the fault matrix alone (e.g. ``--tools stepguard --coverage-only`` after a change
of the detectors or the default policy).

Megatron-core runs last in each rank process: its CPU shim (tests/frameworks/megatron_cpu.py) is
a TorchFunctionMode that stays on for the rest of the process.
"""

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "frameworks"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from peers import cost, faults, tables  # noqa: E402
from peers.tools import TOOLS  # noqa: E402


def _guarded_run(fn, *args):
    """A tool that cannot run here is recorded with the reason, not a failed benchmark."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (any failure of a peer's code is a result)
        return {"error": "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300] if str(e)
                                     else ""), "trace": traceback.format_exc()[-1500:]}


def _tool_results(tool, rank, world, args):
    group = dist.group.WORLD
    out = {"runs": tool.runs, "coverage": {}, "cost": {}}
    for fault in faults.matrix(faults.SMOKE if args.smoke else faults.FULL):
        steps = (faults.SMOKE if args.smoke else faults.FULL)["steps"]
        out["coverage"][fault.name] = _guarded_run(faults.run_fault, tool, fault, args.coverage_size,
                                                   steps, rank, world, group)
    for precision in () if args.coverage_only else ("fp32", "bf16"):
        out["cost"][precision] = _guarded_run(cost.measure, tool, args.cost_size, precision, rank,
                                              world, group, args.rounds, args.block)
    return out


def _rank_main(rank, world, port, out_dir, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    from bench_python_step import steady_host_memory
    steady_host_memory()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for tool in TOOLS:
        if tool.name not in args.tools:
            continue
        if tool.name == "deepspeed":
            import deepspeed
            deepspeed.init_distributed(dist_backend="gloo")
        if tool.name == "megatron_core":  # last: the shim stays on for the rest of the process
            import megatron_cpu
            megatron_cpu.install()
            from megatron.core import parallel_state
            parallel_state.initialize_model_parallel(1, 1)
        t0 = time.monotonic()
        results[tool.name] = _tool_results(tool, rank, world, args)
        results[tool.name]["seconds"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f, default=str)
    dist.destroy_process_group()


def spawn(world, args, timeout):
    """Runs every rank through the framework tests' spawn (a deadline, not join()'s first exit)."""
    from conftest import spawn_ranks
    try:
        return spawn_ranks(_rank_main, world, args, timeout=timeout)
    except AssertionError as e:
        raise SystemExit("bench_peers: %d rank(s): %s" % (world, e)) from None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--iterations", type=int, default=0,
                   help="guarded iterations per cost case (sets --rounds with --block)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--tools", default=",".join(t.name for t in TOOLS))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--coverage-only", action="store_true",
                   help="the fault matrix alone (no cost measurement): minutes, not an hour")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per rank count")
    p.add_argument("--require-complete", action="store_true",
                   help="exit 2 unless the JSON holds every tool, fault and cost case (ctest)")
    args = p.parse_args()
    args.tools = args.tools.split(",")
    args.cost_size, args.coverage_size = ("small", "small") if args.smoke else ("50M", "small")
    if args.smoke:
        args.rounds, args.block = 2, 2
    elif args.iterations:
        args.rounds = max(1, args.iterations // args.block)
    result = {"cost_model": args.cost_size, "coverage_model": args.coverage_size,
              "smoke": args.smoke, "rounds": args.rounds, "block": args.block,
              "threads_per_rank": args.threads,
              "fault_schedule": faults.SMOKE if args.smoke else faults.FULL,
              "versions": tables.versions(), "by_ranks": {}}
    for world in [int(w) for w in args.ranks.split(",")]:
        result["by_ranks"][str(world)] = tables.merge(spawn(world, args, args.timeout))
    result["target"] = tables.target(result)
    print(tables.markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.require_complete:
        with open(args.json) as f:  # what was written, not what is in memory
            missing = tables.missing(json.load(f), args.tools)
        if missing:
            print("bench_peers: missing from the JSON: " + ", ".join(missing), file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    main()

"""pytest setup of the framework tests: each runs a real training framework (DeepSpeed,
Megatron-core, Lightning, HF Transformers) on CPU with Gloo, its ranks as local processes."""

import json
import os
import socket
import tempfile
import time

import torch.multiprocessing as mp

POLICY = os.path.join(os.path.dirname(__file__), "policy.yaml")


def free_port():
    """A free TCP port on the loopback interface, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(rank_main, world, *args, timeout=300):
    """Runs ``rank_main(rank, world, port, out_dir, *args)`` on ``world`` spawned processes and
    returns what each wrote to ``out_dir/rank<r>.json``. A rank that fails fails the call; ranks
    still running after ``timeout`` seconds (a hang: a run takes seconds) are killed and fail it."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(rank_main, args=(world, free_port(), d) + args, nprocs=world,
                                 start_method="spawn", join=False)
        # join() returns False each time a rank exits while others still run: wait again, up
        # to the deadline.
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in ctx.processes:
                    process.kill()
                raise AssertionError("the ranks did not finish within %d s" % timeout)
        out = []
        for r in range(world):
            with open(os.path.join(d, "rank%d.json" % r)) as f:
                out.append(json.load(f))
        return out

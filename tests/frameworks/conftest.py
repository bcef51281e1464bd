"""pytest setup of the framework tests: each runs a real training framework (DeepSpeed,
Megatron-core, Lightning, HF Transformers) on CPU with Gloo, its ranks as local processes."""

import contextlib
import json
import os
import socket
import sys
import tempfile
import time

import pytest
import torch.multiprocessing as mp

POLICY = os.path.join(os.path.dirname(__file__), "policy.yaml")


def free_port():
    """A free TCP port on the loopback interface, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_and_leave(rank, rank_main, *args):
    """A spawned rank: ``rank_main``, then out without the interpreter's teardown, where the
    Gloo (and DeepSpeed shm) threads of a finished job sometimes abort the process ("terminate
    called without an active exception", about 1 run in 8 under DeepSpeed: seen in CI after both
    ranks had written their results; docs/python.md gives users the same advice). A rank whose
    ``rank_main`` raises fails as before."""
    rank_main(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(rank_main, world, *args, timeout=300):
    """Runs ``rank_main(rank, world, port, out_dir, *args)`` on ``world`` spawned processes and
    returns what each wrote to ``out_dir/rank<r>.json``. A rank that fails fails the call; ranks
    still running after ``timeout`` seconds (a hang: a run takes seconds) are killed and fail it.
    Each rank leaves with ``os._exit(0)`` once ``rank_main`` returns (_run_and_leave)."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_run_and_leave, args=(rank_main, world, free_port(), d) + args,
                                 nprocs=world, start_method="spawn", join=False)
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


@pytest.fixture
def hf_offline(monkeypatch, tmp_path):
    """HF Transformers offline, its caches under the test's folder, no reporters; one thread."""
    import torch
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                       ("HF_HOME", str(tmp_path / "hf_home")), ("WANDB_DISABLED", "true"),
                       ("DISABLE_MLFLOW_INTEGRATION", "TRUE")):
        monkeypatch.setenv(key, value)
    torch.set_num_threads(1)


def fp16_on_any_cpu():
    """DeepSpeed's CPU accelerator calls fp16 supported only where oneDNN has fp16 kernels
    (AVX512-FP16 or AMX); torch computes fp16 on any CPU. Said as a GPU says it, so that an fp16
    test does not depend on the build machine's CPU."""
    from deepspeed.accelerator import get_accelerator
    get_accelerator().is_fp16_supported = lambda: True


def deepspeed_step_counters():
    """What a DeepSpeed optimizer step may call that the guard makes unnecessary, as
    (owner, attribute, key) for counted_calls: all-reduces through torch.distributed (DeepSpeed's
    norm and overflow check make them) and DeepSpeed's and torch's gradient-norm functions."""
    import torch
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.fp16 import fused_optimizer, unfused_optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return [(torch.distributed, "all_reduce", "all_reduce"),
            (torch.nn.utils, "get_total_norm", "norms"),
            (torch.nn.utils, "clip_grad_norm_", "norms"),
            (ds_engine, "clip_grad_norm_", "norms"),
            (unfused_optimizer, "get_weight_norm", "norms"),
            (fused_optimizer, "get_flattened_grad_norm", "norms"),
            (bf16_optimizer, "get_global_norm_of_tensors", "norms"),
            (DeepSpeedZeroOptimizer, "get_grad_norm_direct", "norms")]


@contextlib.contextmanager
def counted_calls(targets, when=lambda: True):
    """Counts, by key, the calls of each (owner, attribute, key) of `targets` made inside the
    block while `when()` holds; every attribute is put back afterwards."""
    counts = {key: 0 for _, _, key in targets}
    undo = []
    try:
        for owner, name, key in targets:
            real = getattr(owner, name)

            def counted(*args, _real=real, _key=key, **kwargs):
                if when():
                    counts[_key] += 1
                return _real(*args, **kwargs)
            setattr(owner, name, counted)
            undo.append((owner, name, real))
        yield counts
    finally:
        for owner, name, real in reversed(undo):
            setattr(owner, name, real)


class DataPositions:
    """A training loop's data iterator: yields each item's position in the data (the test
    makes the item from it); ``position`` is the next one. A guard's ``drop_batches`` draws
    from it as from any iterator."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.position += 1
        return self.position - 1

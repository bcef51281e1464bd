"""Test-only shim: runs Megatron-core on CPU. Megatron assumes CUDA in a few places; this maps
exactly these, for the tests' processes only (never imported by stepguard itself):

- a ``device="cuda"``/``torch.device("cuda")`` argument to any torch function (buffers, scalars
  Megatron creates on the GPU) -> the CPU, and ``Tensor.cuda()`` -> the tensor itself;
- ``Tensor.type()`` of a CPU tensor -> the CUDA type name (clip_grads asserts
  ``torch.cuda.FloatTensor``);
- ``torch.cuda.current_device()`` -> the CPU device, ``torch.cuda.synchronize()`` -> nothing;
- ``torch.cuda.current_stream()`` -> a stream whose waits do nothing (megatron-core 0.19 asks
  for it on every gradient sync, for CUDA-graph events the tests never record);
- the model-parallel CUDA RNG tracker's ``fork()`` -> no fork (the CPU generator; the tests run
  without dropout).
"""

import contextlib

import torch


class _NoStream:
    """What ``torch.cuda.current_stream()`` gives on the CPU: waits and syncs that do nothing."""

    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass
from torch.overrides import TorchFunctionMode


def _cpu(value):
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    return value


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" \
                else name
        args = tuple(_cpu(a) for a in args)
        kwargs = {k: _cpu(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def install():
    """Installs the mapping in this process (idempotent)."""
    if getattr(install, "done", False):
        return
    from megatron.core.tensor_parallel import random as mp_random
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda device=None: _NoStream()
    mp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    _CudaToCpu().__enter__()  # for the rest of the process
    install.done = True

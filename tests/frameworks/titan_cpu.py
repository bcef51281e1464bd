"""Test-only shim and data: torchtitan 0.3.0 on CPU ranks with Gloo (never imported by stepguard).

torchtitan assumes an accelerator in a few places; ``install()`` (before torchtitan is imported)
maps exactly these, for the tests' processes only:

- its device: ``torch._utils._get_available_device_type`` -> "cpu" (torchtitan falls back to
  "cuda" when no accelerator is found), and the device module it then asks for memory figures,
  a device name and ``set_device`` -> ``CPU_DEVICE``, whose figures are zeros;
- FSDP2's reduce-scatter with ``set_gradient_divide_factor(1.0)`` (torchtitan divides by the
  global token count itself): ``PREMUL_SUM(1.0)``, which Gloo lacks -> a plain sum
  (``set_force_sum_reduction_for_comms``: then FSDP divides by 1.0, the same numbers).

And ``config(...)``: torchtitan's own llama3 debug model (``llama3_debugmodel``), cut to 2 layers,
with two test-only parts: its FlexAttention (no backward on CPU) swapped for torchtitan's
``ScaledDotProductAttention`` (causal), and synthetic data (``SyntheticLoader``: random tokens,
a seed per batch and data-parallel rank, its position saved in checkpoints; ``ToyTokenizer``:
the vocabulary size alone, no tokenizer files).
"""

import os
import types
from dataclasses import dataclass

import torch
import torch._utils


def _cpu_device_module():
    m = types.SimpleNamespace()
    m.set_device = lambda device: None
    m.current_device = lambda: 0
    m.device_count = lambda: 1
    m.get_device_name = lambda device=None: "cpu"
    m.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=1 << 34)
    m.reset_peak_memory_stats = lambda *args: None
    m.empty_cache = lambda: None
    m.memory_stats = lambda device=None: {}
    m.synchronize = lambda *args: None
    m.is_available = lambda: True
    return m


CPU_DEVICE = _cpu_device_module()


def install():
    torch._utils._get_available_device_type = lambda: "cpu"
    real_module = torch._utils._get_device_module
    torch._utils._get_device_module = (
        lambda device_type="cpu": CPU_DEVICE if device_type == "cpu" else real_module(device_type))
    from torch.distributed.fsdp import FSDPModule
    real_divide = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor):
        real_divide(self, factor)
        if factor == 1.0:
            self.set_force_sum_reduction_for_comms(True)
    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _classes():
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class ToyTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab: int = 2048

        def __init__(self, config, tokenizer_path=None):
            super().__init__()
            self.vocab = config.vocab
            self.eos_id = 0

        def encode(self, *args, **kwargs):
            return []

        def decode(self, *args, **kwargs):
            return ""

        def get_vocab_size(self):
            return self.vocab

    class SyntheticLoader(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab: int = 2048

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len,
                     local_batch_size, snapshot_every_n_steps=None):
            self.vocab, self.rank = config.vocab, dp_rank
            self.seq, self.batch = seq_len, local_batch_size
            self.position = 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(1000 * self.position + self.rank)
                self.position += 1
                tokens = torch.randint(1, self.vocab, (self.batch, self.seq + 1), generator=g)
                positions = torch.arange(self.seq).expand(self.batch, self.seq).contiguous()
                yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

        def state_dict(self):
            return {"position_rank%d" % self.rank: self.position}

        def load_state_dict(self, state_dict):
            self.position = state_dict["position_rank%d" % self.rank]

    return ToyTokenizer, SyntheticLoader


def config(steps, pp=1, max_norm=1.0, folder=None, checkpoint_every=None):
    """torchtitan's llama3 debug-model config for the CPU tests (see the module's docstring):
    FSDP2 over the ranks a pipeline stage has (all of them without pipeline parallelism),
    ``pp`` pipeline stages (1F1B, 2 micro-batches a step), 2 samples of 32 tokens a rank."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    toy_tokenizer, synthetic_loader = _classes()
    cfg = llama3_debugmodel()
    model = cfg.model_spec.model
    model.layers = model.layers[:2]
    for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    cfg.tokenizer = toy_tokenizer.Config()
    cfg.dataloader = synthetic_loader.Config()
    cfg.training = TrainingConfig(local_batch_size=2, seq_len=32, steps=steps, max_norm=max_norm,
                                  disable_cuda_graphs=True)
    cfg.parallelism = ParallelismConfig(data_parallel_shard_degree=-1,
                                        pipeline_parallel_degree=pp,
                                        pipeline_parallel_schedule="1F1B",
                                        pipeline_parallel_microbatch_size=1)
    cfg.checkpoint = CheckpointManager.Config(
        enable=checkpoint_every is not None, interval=checkpoint_every or 10,
        folder="checkpoint", last_save_model_only=False)
    cfg.validator.enable = False
    cfg.activation_checkpoint = None
    cfg.metrics.log_freq = 1
    cfg.debug.seed = 0
    cfg.dump_folder = folder or os.path.join(os.environ.get("TMPDIR", "/tmp"), "titan")
    return cfg

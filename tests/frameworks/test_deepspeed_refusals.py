"""What the DeepSpeed integration refuses because its update would differ from DeepSpeed's own,
with the real DeepSpeed on 1 rank (CPU, Gloo): mixture-of-experts layers (DeepSpeed's norm counts
each rank's experts; the guard's layout would count them as replicas). The Muon optimizer, which
DeepSpeed orthogonalises in its own step, is accepted (fp32 and bf16 under ZeRO 1; guarded right:
test_deepspeed's fault matrix)."""

import json
import os

import torch
import torch.nn as nn

os.environ["DS_ACCELERATOR"] = "cpu"
import deepspeed  # noqa: E402  (a missing DeepSpeed fails the test)

import stepguard.integrations.deepspeed as sg_deepspeed  # noqa: E402
from conftest import POLICY, spawn_ranks  # noqa: E402
from test_deepspeed import _model  # noqa: E402

BASE = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}


class _MoeNet(nn.Module):
    """A dense layer, then a DeepSpeed MoE layer of 2 experts (expert parallel 1)."""

    def __init__(self):
        super().__init__()
        from deepspeed.moe.layer import MoE
        torch.manual_seed(0)
        self.dense = nn.Linear(8, 8)
        self.moe = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=1, k=1)

    def forward(self, x):
        return self.moe(self.dense(x))[0]


def _moe_engine():
    model = _MoeNet()
    return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                config=BASE)[0]


def _muon_engine(precision):
    """DeepSpeed's Muon (MuonWithAuxAdam): matrices on Muon, the rest on its Adam."""
    model = _model()
    for p in model.parameters():
        p.use_muon = p.ndim >= 2
    config = dict(BASE, optimizer={"type": "Muon", "params": {"lr": 1e-3}}, **precision)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                config=config)[0]


def _rank_main(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    engines = (("moe", _moe_engine), ("muon", lambda: _muon_engine({})),
               ("muon_bf16_zero1", lambda: _muon_engine({"bf16": {"enabled": True},
                                                         "zero_optimization": {"stage": 1}})))
    for name, make in engines:
        engine = make()
        out[name + "_built"] = type(engine.optimizer).__name__
        try:
            sg_deepspeed.guard_engine(engine, policy=POLICY)
            out[name] = "accepted"
        except ValueError as error:
            out[name] = str(error)
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


def test_moe_is_refused_naming_why_and_muon_accepted():
    (got,) = spawn_ranks(_rank_main, 1)
    assert "mixture-of-experts layers" in got["moe"], got
    # Muon is guarded (DeepSpeed's own step orthogonalises; test_deepspeed's fault matrix)
    assert got["muon"] == got["muon_bf16_zero1"] == "accepted", got
    assert got["muon_bf16_zero1_built"] == "DeepSpeedZeroOptimizer", got


def test_check_config_refuses_what_a_config_alone_shows_and_leaves_auto_to_the_engine():
    """``check_config`` (HF's attach, Lightning's fit start): before any engine exists."""
    import pytest
    zero = lambda stage, **kw: {"zero_optimization": dict({"stage": stage}, **kw)}
    for config in (zero(2, offload_optimizer={"device": "nvme"}),
                   zero(3, offload_param={"device": "cpu"})):
        with pytest.raises(ValueError, match="offload to NVMe, or of the parameters"):
            sg_deepspeed.check_config(config)
    with pytest.raises(ValueError, match="fp16 without ZeRO"):
        sg_deepspeed.check_config({"fp16": {"enabled": True}})
    for config in ({}, zero(2), zero(3, offload_optimizer={"device": "none"}),
                   {"fp16": {"enabled": "auto"}}, dict(zero(2), fp16={"enabled": True}),
                   zero("auto", offload_optimizer={"device": "cpu"}),
                   zero(1, offload_optimizer={"device": "cpu"}),
                   zero(2, offload_optimizer={"device": "cpu"}),
                   zero(3, offload_optimizer={"device": "cpu"}),
                   zero(3, offload_param={"device": "none"})):
        sg_deepspeed.check_config(config)  # accepted here; the engine is checked later

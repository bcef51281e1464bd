"""What every tool's iteration shares: the model (train_gpt's CharTransformer behind a token-in,
logits-out wrapper), its sizes, the batches, the data-parallel gradient average and the replica
fingerprint. Nothing here checks or decides anything."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration", "pytorch"))
from train_gpt import CharTransformer  # noqa: E402

VOCAB = 96
# The 50M case of bench_python_step (d 768, 7 blocks, batch 8 x 128) and the demo's model.
SIZES = {
    "50M": dict(d_model=768, heads=12, layers=7, batch=8, context=128),
    "demo": dict(d_model=128, heads=4, layers=2, batch=32, context=64),
    "small": dict(d_model=32, heads=2, layers=1, batch=4, context=16),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class LanguageModel(nn.Module):
    """CharTransformer with tokens in and logits out, so an engine can call it as a module."""

    def __init__(self, size):
        super().__init__()
        cfg = SIZES[size]
        self.net = CharTransformer(VOCAB, context=cfg["context"], d_model=cfg["d_model"],
                                   heads=cfg["heads"], layers=cfg["layers"])

    def forward(self, tokens):
        return self.net(self.net.embed(tokens))


def build_model(size, precision, seed=0):
    torch.manual_seed(seed)
    return LanguageModel(size).to(DTYPES[precision])


def batch(size, step, rank):
    """The batch of a step on a rank: same sequence for every tool, different per rank."""
    cfg = SIZES[size]
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randint(0, VOCAB, (cfg["batch"], cfg["context"]), generator=g)
    # A learnable target (the next token is the current one plus one) so the loss falls.
    return x, (x + 1) % VOCAB


def loss_of(logits, y):
    return F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))


def average_gradients(params, world):
    """What DDP does after backward: one all-reduce over the flattened gradients, divided by the
    world size. A no-op on one rank."""
    if world == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(world)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def fingerprint(params):
    """A float64 sum of every parameter (and of their squares), NaN-preserving."""
    total = torch.zeros(2, dtype=torch.float64)
    for p in params:
        d = p.detach().double()
        total[0] += d.sum()
        total[1] += (d * d).sum()
    return total


def replicas_equal(params, world):
    """True when every rank's parameters have the same fingerprint (bitwise), and are finite."""
    mine = fingerprint(params)
    finite = bool(torch.isfinite(mine).all())
    if world == 1:
        return True, finite
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    equal = all(torch.equal(g, gathered[0]) or (torch.isnan(g).all() and torch.isnan(
        gathered[0]).all()) for g in gathered)
    return equal, finite


def agree_any(flag, world):
    """True on every rank when ``flag`` is true on any (a MAX all-reduce; one rank: itself)."""
    if world == 1:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())

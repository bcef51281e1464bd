#!/usr/bin/env python3
"""The Python demo: the character transformer of `stepguard demo`, trained with plain PyTorch DDP
over Gloo and guarded by stepguard.GuardedOptimizer, with the same injected faults, flags and
summary JSON as the C++ demo.

    torchrun --nproc_per_node 4 integration/pytorch/train_gpt.py --steps 200 \
        --inject nan_grad@40:1 --inject nan_loss@80 --summary-json summary.json

Run with PYTHONPATH=build/python (or an installed stepguard). One process without torchrun is one
rank. `--optimizer zero` shards AdamW's state over the ranks with torch's ZeroRedundancyOptimizer
(ZeRO-1), which the guard recognises by itself.
"""

import argparse
import datetime
import hashlib
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import stepguard
from stepguard import _files

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_POLICY = os.path.join(HERE, "..", "..", "configs", "policies", "default.yaml")
FAULTS = ("nan_grad", "inf_grad", "nan_loss", "nan_input", "overflow", "lr_spike", "loss_spike",
          "corrupt_weights", "kill", "transient_nan")
NAN_GRAD_PARAM = "blocks.1.qkv.weight"
INF_GRAD_PARAM = "blocks.0.fc_in.weight"
CORRUPT_PARAM = "blocks.0.proj.weight"


# -- the model: pre-norm decoder blocks, causal attention, GELU MLP ------------------------------
class Block(nn.Module):
    def __init__(self, d_model, heads, context):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc_in = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        # Additive causal mask (Gloo broadcasts no bool buffers under DDP).
        self.register_buffer("causal_bias", torch.full((context, context), float("-inf")).triu(1))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        scores = scores + self.causal_bias[:t, :t]
        mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c)
        h = x + self.proj(mixed)
        return h + self.fc_out(F.gelu(self.fc_in(self.ln2(h))))


class CharTransformer(nn.Module):
    def __init__(self, vocab, context=64, d_model=128, heads=4, layers=2):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, context) for _ in range(layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "weight" in name and p.dim() == 2:
                    p.normal_(0.0, 0.02)
                elif "bias" in name:
                    p.zero_()

    def embed(self, tokens, poison_row=-1):
        x = self.token_embedding(tokens) + self.position_embedding(
            torch.arange(tokens.shape[1], device=tokens.device))
        if poison_row >= 0:
            x = x.clone()
            x[poison_row] = float("nan")
        return x

    def forward(self, x):  # x: the input embeddings
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


# -- data: the license texts every Debian system ships ---------------------------------------
# The default texts: those of /usr/share/common-licenses that Debian 12 and 13 ship byte for byte
# alike (as `stepguard demo`: the same data, so the same run, on both releases).
DEFAULT_CORPUS_DIR = "/usr/share/common-licenses"
STABLE_LICENSE_TEXTS = ("Apache-2.0", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-3", "LGPL-3", "MPL-1.1",
                        "MPL-2.0")
# A text of the corpus is a book at most (as the C++ demo's corpus.cpp).
MAX_CORPUS_TEXT_BYTES = 64 << 20


def load_corpus(directory):
    """The default corpus when ``directory`` is None, else every file of ``directory`` (links
    followed, each file once) in name order."""
    if directory is None:
        directory, names = DEFAULT_CORPUS_DIR, STABLE_LICENSE_TEXTS
        missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            raise SystemExit("train_gpt: corpus file %r does not exist (the default texts; "
                             "--corpus-dir DIR reads every file of a directory of your own)"
                             % os.path.join(directory, missing[0]))
    else:
        names, seen = [], set()
        for name in sorted(os.listdir(directory)):
            real = os.path.realpath(os.path.join(directory, name))
            if os.path.isfile(real) and real not in seen:
                seen.add(real)
                names.append(name)
    text = b""
    for name in names:
        try:
            text += _files.read_regular(os.path.join(directory, name), MAX_CORPUS_TEXT_BYTES)
        except _files.FileError:
            continue  # not a regular file of a text's size: left out, as the C++ demo does
        text += b"\n"
    if len(text) < 4096:
        raise SystemExit("train_gpt: corpus directory %r holds too little text" % directory)
    alphabet = sorted(set(text))
    index = {c: i for i, c in enumerate(alphabet)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(alphabet)


def batch(tokens, seed, batch_index, batch_size, context):
    g = torch.Generator().manual_seed(seed * 1_000_003 + batch_index)
    starts = torch.randint(0, tokens.numel() - context - 1, (batch_size,), generator=g)
    rows = starts[:, None] + torch.arange(context + 1)[None, :]
    window = tokens[rows]
    return window[:, :-1], window[:, 1:]


# -- the command line (the flags of `stepguard demo` that apply here) ---------------------------
def parse_injection(text):
    try:
        kind, rest = text.split("@", 1)
        step, _, rank = rest.partition(":")
        if kind not in FAULTS:
            raise ValueError("unknown fault %r (one of %s)" % (kind, ", ".join(FAULTS)))
        return kind, int(step), int(rank) if rank else -1
    except ValueError as e:
        raise argparse.ArgumentTypeError("--inject %s: %s" % (text, e))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--inject", type=parse_injection, action="append", default=[],
                   metavar="KIND@STEP[:RANK]")
    p.add_argument("--policy", default=None, help="policy file (default: default.yaml)")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--trace", default=None, help="trace path; rank r writes .rank<r> beside it")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--incident-dir", default=None)
    p.add_argument("--metrics-port", type=int, default=-1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    # 1e-3 as `stepguard demo`: at 2e-3 the first block's attention logits outgrow the model near
    # step 10 (a 50-100x grad-norm spike, loss back at ln(vocab)) on every corpus and seed tried.
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus-dir", default=None,
                   help="every file of this directory (default: the license texts of %s that "
                        "Debian 12 and 13 ship alike)" % DEFAULT_CORPUS_DIR)
    p.add_argument("--collective-timeout", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--optimizer", choices=("adamw", "zero"), default="adamw",
                   help="adamw: AdamW on every rank; zero: AdamW's state sharded over the ranks "
                        "(ZeroRedundancyOptimizer, ZeRO-1)")
    args = p.parse_args(argv)
    if args.steps <= 0:
        p.error("--steps must be positive")
    return args


def injected(args, kind, step, rank):
    return any(k == kind and s == step and r in (-1, rank) for k, s, r in args.inject)


def rank_path(path, rank, world):
    return path if not path or world == 1 else "%s.rank%d" % (path, rank)


def param_hash(model):
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    group = store = None
    if world > 1:
        # The job's store (env://, as torchrun sets it up) is shared with the guard: a step whose
        # collective fails then names the ranks that are gone (a dead node's ranks, say).
        timeout = datetime.timedelta(seconds=args.collective_timeout)
        store = next(dist.rendezvous("env://", timeout=timeout))[0]
        dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world, timeout=timeout)
        group = dist.group.WORLD
    elif args.optimizer == "zero":  # ZeRO needs a process group, even of one rank
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(args.seed)
    tokens, vocab = load_corpus(args.corpus_dir)
    raw = CharTransformer(vocab, context=args.context)
    model = nn.parallel.DistributedDataParallel(raw) if world > 1 else raw
    optimizer = make_optimizer(args, raw)
    guard = stepguard.GuardedOptimizer(
        optimizer, raw.named_parameters(), policy=args.policy or DEFAULT_POLICY,
        process_group=group, trace_path=rank_path(args.trace or "", rank, world),
        store=dist.PrefixStore("stepguard", store) if store is not None else None,
        incident_dir=args.incident_dir or "", checkpoint_dir=args.checkpoint_dir or "",
        checkpoint_every=args.checkpoint_every if args.checkpoint_dir else 0,
        metrics_port=args.metrics_port + int(os.environ.get("LOCAL_RANK", "0"))
        if args.metrics_port > 0 else args.metrics_port,
        metrics_run_label="train_gpt", collective_timeout=args.collective_timeout)
    guard.track_buffers(raw.named_buffers())
    named = dict(raw.named_parameters())
    summary = train(args, model, raw, guard, named, tokens, vocab, rank, world)
    hashes = [None] * world
    if world > 1:
        dist.all_gather_object(hashes, summary.pop("param_hash"))
        finite = [None] * world
        dist.all_gather_object(finite, summary["params_finite"])
        summary["params_finite"] = all(finite)
    else:
        hashes = [summary.pop("param_hash")]
    summary["param_hashes"] = hashes
    if rank == 0:
        print(json.dumps({k: summary[k] for k in ("steps", "applied", "skipped", "rollbacks",
                                                  "final_loss")}), file=sys.stderr)
        if args.summary_json:
            _files.write_bytes(args.summary_json, json.dumps(summary, indent=2).encode())
    if dist.is_initialized():
        dist.destroy_process_group()
    return 3 if summary["aborted"] else 0


def make_optimizer(args, raw):
    adamw = dict(lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    if args.optimizer == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(raw.parameters(), optimizer_class=torch.optim.AdamW,
                                       **adamw)
    return torch.optim.AdamW(raw.parameters(), **adamw)


def train(args, model, raw, guard, named, tokens, vocab, rank, world):
    applied_losses, incidents = [], []
    initial_loss = None
    batch_index = 0
    for step in range(1, args.steps + 1):
        x_tokens, y = batch(tokens, args.seed, batch_index * world + rank, args.batch_size,
                            args.context)
        batch_index += 1
        if injected(args, "kill", step, rank):
            os._exit(137)
        if injected(args, "corrupt_weights", step, rank):
            with torch.no_grad():
                named[CORRUPT_PARAM].view(-1)[0] = float("nan")
        lr_spike = injected(args, "lr_spike", step, rank)
        if lr_spike:
            for g in guard.param_groups:
                g["lr"] *= 1000.0
        poison = 0 if injected(args, "nan_input", step, rank) else -1

        def forward_backward(mode, check, net):
            x = raw.embed(x_tokens, poison)
            if check:
                guard.check_inputs([x])
            logits = net(x)
            loss = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1))
            if injected(args, "nan_loss", step, rank):
                loss = loss * float("nan")
            if injected(args, "loss_spike", step, rank):
                loss = loss * 1000.0
            scaled = guard.scale_loss(loss) if mode != "fp32" else loss
            scaled.backward()
            return loss

        def inject_gradient_faults():
            with torch.no_grad():
                if injected(args, "nan_grad", step, rank):
                    named[NAN_GRAD_PARAM].grad.view(-1)[7] = float("nan")
                if injected(args, "inf_grad", step, rank):
                    named[INF_GRAD_PARAM].grad.view(-1)[3] = float("inf")

        def replay(mode):
            guard.zero_grad()
            # The plain module: only the ranks a fault came from replay, and DDP's forward
            # broadcasts buffers (a collective) even under no_sync().
            with model.no_sync() if world > 1 else _null():
                loss = forward_backward(mode, False, raw)
            inject_gradient_faults()  # deterministic faults come back; a transient one does not
            return loss

        guard.set_replay(replay)
        guard.zero_grad()
        loss = forward_backward("as_is", True, model)
        inject_gradient_faults()
        if injected(args, "transient_nan", step, rank):
            with torch.no_grad():
                named[NAN_GRAD_PARAM].grad.view(-1)[11] = float("nan")
        report = guard.step(loss.detach())
        if lr_spike:
            for g in guard.param_groups:
                g["lr"] /= 1000.0
        batch_index += report.batches_to_skip
        if report.applied:
            if initial_loss is None:
                initial_loss = report.loss
            applied_losses.append(report.loss)
        if report.incident is not None:
            inc = report.incident
            incidents.append({k: inc[k] for k in ("step", "signal", "action", "cause", "tensors",
                                                  "ranks", "reason", "evidence", "fixes")})
            if rank == 0:
                print("  step %d: %s -> %s, cause %s" % (inc["step"], inc["signal"],
                                                          inc["action"], inc["cause"]),
                      file=sys.stderr)
        if report.aborted:
            break
    guard.set_replay(None)
    tail = applied_losses[-10:]
    stats = guard.stats()
    totals = stats.totals.to_dict()
    finite = all(bool(torch.isfinite(p).all()) for p in raw.parameters())
    if not stats.aborted:
        if world > 1:
            dist.barrier()
        guard.commit_pending_checkpoint()
    stats = guard.stats()  # after the commit's collective
    return {
        "steps": totals["steps"], "applied": totals["applied"], "skipped": totals["skipped"],
        "rollbacks": totals["rolled_back"], "aborted": totals["aborted"] > 0,
        "initial_loss": initial_loss, "final_loss": sum(tail) / len(tail) if tail else None,
        "params_finite": finite, "param_hash": param_hash(raw), "loss_scale": stats.loss_scale,
        "lr_factor": stats.lr_factor, "ranks": world, "seed": args.seed,
        "collectives": stats.collective_calls, "step_buffer_bytes": stats.step_buffer_bytes,
        "batches_consumed": batch_index,
        "incidents": incidents, "policy": args.policy or "default.yaml",
        "optimizer": args.optimizer,
    }


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except (stepguard.ConsensusError, RuntimeError):
        # The ranks can no longer agree (a peer is gone: the guard's ConsensusError, or DDP's
        # own gradient all-reduce failing first, a RuntimeError from Gloo): say why and leave
        # at once. Tearing down a process group whose peers are gone can wait for their
        # deadline, or abort in its threads' destructors ("terminate called without an active
        # exception"), and the job's exit code would then be a signal's.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(code)

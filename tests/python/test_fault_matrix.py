"""The practitioners' fault list against the default policy: a small decoder under DDP on 2 Gloo
ranks (real processes over loopback), one scenario after another in the same two processes, each
with a fresh model and guard. What each scenario checks is what a practitioner expects to read:

- fp16 startup overflow (the initial loss scale far too high): every step of the streak is
  `precision_overflow` with signal `overflow`, only skipped while the scale backs off; the LR is
  never lowered and nothing rolls back.
- a 10x loss spike at step 20 on one rank: caught from the recent losses, the origin rank named
  on every rank, cause `data`; the same spike on every rank: cause `divergence`, both ranks.
- a learning-rate bug from step 150: x100 is rolled back and cut again at every spike that comes
  back and by the recovery watch until the loss is back near its level; x1000, which the cuts
  cannot fix, ends when the rollback budget is spent, in an abort with cause `divergence`,
  "learning rate too high", and the `stepguard_aborted` gauge the StepguardAborted alert reads.
- a NaN made in the forward of `blocks.0.ln1` on one rank, without user probes: the replay,
  given the model, names that module (hooks for the replay only).
- one bad sample on one rank (its loss 7x and NaN gradients on the same step): skipped, cause
  backward, not a rollback with an LR cut called divergence.
- a weight set to 1e30 on one rank: the NaN loss that follows names that weight.
- a NaN in one rank's float batch without check_inputs(): the report says the inputs were not
  checked (never that they are finite), and the other rank points at the origin's incident.
- the first 200 steps of the decoder and of a GPT-2 (transformers, trained on the GPL-3 text)
  under the default policy: no incident at all.
"""

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import stepguard

VOCAB, SEQ, BATCH = 32, 16, 8


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, fp16):
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        # fp16 activations: the backward casts each gradient through fp16 here (Inf above 65504).
        return x.half().float() if fp16 else x


class Decoder(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, VOCAB)
        self.fp16 = False

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.fp16)
        return self.head(x)


def batch(step, rank):
    """Sequences with structure (t_i = a * i + b mod VOCAB): the loss falls as the model learns."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    a = torch.randint(1, 4, (BATCH, 1), generator=g)
    b = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = (a * torch.arange(SEQ + 1) + b) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def guard_for(model, lr, **options):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    guard = stepguard.GuardedOptimizer(opt, model.module.named_parameters(), policy="default",
                                       process_group=dist.group.WORLD, collective_timeout=60,
                                       **options)
    return opt, guard


def run(guard, model, steps, loss_factor=lambda step: 1.0, lr_at=None, opt=None, replay=True,
        poison=None, loss_term=lambda step, logits: 0.0):
    """Trains `steps` steps; returns one row per step (the report's figures and its incident)."""
    rank = dist.get_rank()
    rows = []
    state = {}

    def replay_fn(mode):
        x, y = state["batch"]
        model.module.fp16 = mode != "fp32" and state["fp16"]
        with model.no_sync():  # a replay runs on the origin ranks alone: no gradient all-reduce
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            loss = loss * loss_factor(state["step"]) + loss_term(state["step"], logits)
            guard.scale_loss(loss).backward()
        if mode != "fp32":
            store_grads(model)
        model.module.fp16 = state["fp16"]
        return loss

    if replay:
        guard.set_replay(replay_fn, model=model)
    if poison is not None and not callable(poison):
        # A weight set far beyond any trained value on a chosen step, on one rank.
        poison_step, poison_rank, param = poison
        poison = None
    else:
        poison_step = None
    if poison is not None:
        # A forward NaN inside blocks.0.ln1 on a chosen step (and its replay): no user probes.
        def hook(_module, _inputs, output):
            if poison(state["step"]):
                output = output.clone()
                output[0, 0, 0] = float("nan")
            return output
        model.module.blocks[0].ln1.register_forward_hook(hook)
    for step in range(1, steps + 1):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        if step == poison_step and rank == poison_rank:
            with torch.no_grad():
                param.view(-1)[0] = 1e30
        x, y = batch(step, rank)
        state.update(batch=(x, y), step=step, fp16=model.module.fp16)
        guard.zero_grad()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss = loss * loss_factor(step) + loss_term(step, logits)
        guard.scale_loss(loss).backward()
        store_grads(model)
        try:
            report = guard.step(loss.detach())
        except stepguard.StepguardError as e:  # after an abort
            rows.append({"step": step, "refused": str(e)})
            break
        rows.append({"step": step, "outcome": str(report.outcome).split(".")[-1],
                     "loss": report.loss, "lr_factor": report.lr_factor,
                     "loss_scale": report.loss_scale, "incident": incident_row(report)})
    guard.set_replay(None)
    return rows


def incident_row(report):
    incident = report.incident
    return None if incident is None else {
        key: incident[key]
        for key in ("signal", "cause", "ranks", "rank_causes", "evidence", "fixes", "reason")}


def store_grads(model):
    """fp16 training keeps its gradients in fp16: above 65504 they are Inf."""
    if model.module.fp16:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.copy_(p.grad.half().float())


def ddp(seed):
    torch.manual_seed(seed)
    return nn.parallel.DistributedDataParallel(Decoder())


def scenario_overflow():
    model = ddp(1)
    model.module.fp16 = True
    presets = stepguard.policy_presets()
    # The default policy with an initial scale far too high for these gradients (2^30).
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = stepguard.GuardedOptimizer(
        opt, model.module.named_parameters(),
        policy_yaml=presets["default"] + "loss_scale: {init_scale: 1073741824}\n",
        process_group=dist.group.WORLD, collective_timeout=60)
    return run(guard, model, 40)


def scenario_spike(ranks):
    model = ddp(2)
    _, guard = guard_for(model, 3e-3)
    rank = dist.get_rank()
    return run(guard, model, 40,
               loss_factor=lambda step: 10.0 if step == 20 and rank in ranks else 1.0)


def scenario_lr_bug(factor):
    model = ddp(3)
    opt, guard = guard_for(model, 3e-3, metrics_port=0, metrics_bind_address="127.0.0.1")
    rows = run(guard, model, 450, lr_at=lambda step: 3e-3 * (factor if step > 150 else 1.0),
               opt=opt, replay=False)
    return {"rows": rows, "metrics": guard.metrics_text()}


def scenario_forward_nan():
    model = ddp(6)
    _, guard = guard_for(model, 3e-3)
    rank = dist.get_rank()
    return run(guard, model, 14, poison=lambda step: step == 10 and rank == 1)


def scenario_bad_sample():
    """One bad sample on rank 1 at step 12, as a hand-written loss meets it: that rank's loss 7x
    and NaN gradients on the same step (sqrt at 0: an infinite derivative times 0)."""
    model = ddp(7)
    _, guard = guard_for(model, 3e-3)
    rank = dist.get_rank()
    bad = lambda step: step == 12 and rank == 1  # noqa: E731

    def term(step, logits):
        if not bad(step):
            return 0.0
        return (logits[0, 0, 0] - logits[0, 0, 0].detach()).abs().sqrt()
    return run(guard, model, 16, loss_factor=lambda step: 7.0 if bad(step) else 1.0,
               loss_term=term)


def scenario_huge_weight():
    model = ddp(6)
    _, guard = guard_for(model, 3e-3)
    return run(guard, model, 10, poison=(10, 1, model.module.blocks[0].mlp[0].weight))


def scenario_unchecked_nan_batch():
    """The README's first example's shape (float inputs, no check_inputs()): a NaN in rank 1's
    batch at step 8."""
    torch.manual_seed(8)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    _, guard = guard_for(model, 1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    rows = []
    for step in range(1, 11):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True)
        if step == 8 and dist.get_rank() == 1:
            x[3, 2] = float("nan")
        guard.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        rows.append({"step": step, "incident": incident_row(guard.step(loss.detach()))})
    return rows


def scenario_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(4)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")
    model = nn.parallel.DistributedDataParallel(GPT2LMHeadModel(config))
    with open("/usr/share/common-licenses/GPL-3", "rb") as f:  # the demo's corpus: stable text
        text = torch.tensor(list(f.read()), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = stepguard.GuardedOptimizer(opt, model.module.named_parameters(), policy="default",
                                       process_group=dist.group.WORLD, collective_timeout=60)
    g = torch.Generator().manual_seed(dist.get_rank())
    incidents = []
    losses = []
    for step in range(1, 201):
        starts = torch.randint(0, text.numel() - 65, (8,), generator=g)
        x = torch.stack([text[s:s + 64] for s in starts])
        guard.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        report = guard.step(loss.detach())
        losses.append(report.loss)
        if report.incident is not None:
            incidents.append({"step": step, "reason": report.incident["reason"]})
    return {"incidents": incidents, "first": losses[0], "last": losses[-1]}


def scenario_decoder_clean():
    model = ddp(5)
    _, guard = guard_for(model, 3e-3)
    return run(guard, model, 200, replay=False)


def rank_main(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    out = {"overflow": scenario_overflow(), "spike_one": scenario_spike({1}),
           "spike_all": scenario_spike({0, 1}), "lr_bug": scenario_lr_bug(100.0),
           "lr_bug_1000": scenario_lr_bug(1000.0),
           "forward_nan": scenario_forward_nan(), "huge_weight": scenario_huge_weight(),
           "bad_sample": scenario_bad_sample(),
           "nan_batch": scenario_unchecked_nan_batch(), "decoder_clean": scenario_decoder_clean(),
           "gpt2": scenario_gpt2()}
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def spawn_scenarios(main, world=2):
    """Runs ``main(rank, world, init_file, out_dir)`` on `world` Gloo ranks; each rank's JSON."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(main, args=(world, os.path.join(d, "init"), d), nprocs=world, join=True)
        out = []
        for r in range(world):
            with open(os.path.join(d, "rank%d.json" % r)) as f:
                out.append(json.load(f))
        return out


@pytest.fixture(scope="module")
def matrix():
    return spawn_scenarios(rank_main)


def incidents(rows):
    return [r for r in rows if r.get("incident")]


def test_an_fp16_overflow_streak_is_overflow_on_every_step_and_only_skipped(matrix):
    for rank, out in enumerate(matrix):
        rows = out["overflow"]
        streak = [r for r in rows if r["incident"]]
        assert len(streak) >= 2, (rank, rows[:3])
        assert streak[0]["step"] == 1
        for r in streak:
            assert r["incident"]["signal"] == "overflow", r
            assert r["incident"]["cause"] == "precision_overflow", r
            assert r["outcome"] == "kSkipped" or r["outcome"] == "skipped", r
        # The streak is the first steps, then training applies steps; the LR was never touched.
        assert [r["step"] for r in streak] == list(range(1, len(streak) + 1))
        assert all(r["lr_factor"] == 1.0 for r in rows)
        assert rows[-1]["loss"] < rows[len(streak)]["loss"]
        assert rows[0]["loss_scale"] < 2 ** 30


def test_a_one_rank_loss_spike_at_step_20_names_that_rank_and_its_batch(matrix):
    for rank, out in enumerate(matrix):
        found = incidents(out["spike_one"])
        assert [r["step"] for r in found] == [20], found
        incident = found[0]["incident"]
        assert incident["signal"] == "loss_spike"
        assert incident["ranks"] == [1]
        assert incident["rank_causes"] == {"1": "data"}
        assert incident["cause"] == "data"
        if rank == 1:
            assert "the loss spiked on rank 1 only" in incident["evidence"][0]
            assert incident["fixes"][0].startswith("skip that batch and inspect it")
        else:
            assert "the fault came from rank 1" in incident["evidence"][0]


def test_a_loss_spike_on_every_rank_at_step_20_is_divergence_on_both(matrix):
    for out in matrix:
        found = incidents(out["spike_all"])
        assert [r["step"] for r in found] == [20], found
        incident = found[0]["incident"]
        assert incident["cause"] == "divergence"
        assert incident["ranks"] == [0, 1]


def test_a_learning_rate_bug_x100_is_cut_again_until_the_loss_comes_back(matrix):
    for out in matrix:
        rows = out["lr_bug"]["rows"]
        assert not incidents(rows[:150]), incidents(rows[:150])
        level = sum(r["loss"] for r in rows[130:150]) / 20
        found = incidents(rows[150:])
        assert found and all(r["incident"]["cause"] == "divergence" for r in found), found
        # Rolled back and cut at every spike that came back, then by the recovery watch.
        raised = [r for r in found if r["incident"]["signal"] == "loss_not_recovered" or
                  "loss_not_recovered" in r["incident"]["reason"]]
        assert raised, found
        assert any("learning rate too high" in line for r in raised
                   for line in r["incident"]["evidence"])
        assert min(r["lr_factor"] for r in rows[150:]) <= 0.0625
        # Contained: the loss is back near its level from before the bug, without an abort.
        assert not any(r.get("outcome") == "aborted" for r in rows)
        tail = [r["loss"] for r in rows[-20:]]
        assert sum(tail) / len(tail) < 2.0 * level, (level, tail)


def test_a_learning_rate_bug_x1000_the_cuts_cannot_fix_aborts_as_divergence(matrix):
    for out in matrix:
        rows = out["lr_bug_1000"]["rows"]
        aborted = [r for r in rows if r.get("outcome") == "aborted"]
        assert aborted, [r for r in rows if r.get("incident")][:8]
        last = aborted[0]
        assert 150 < last["step"] <= 450
        assert last["incident"]["cause"] == "divergence"
        assert any("learning rate too high" in line for line in last["incident"]["evidence"])
        assert "limits.max_rollbacks" in last["incident"]["reason"]
        assert last["incident"]["fixes"][0].startswith("lower the learning rate")
        assert "refused" in rows[-1] or rows[-1] is last
        # The gauge the StepguardAborted alert reads.
        assert any(line.startswith("stepguard_aborted") and line.rstrip().endswith(" 1")
                   for line in out["lr_bug_1000"]["metrics"].splitlines())


def test_a_forward_nan_names_the_first_bad_module_without_user_probes(matrix):
    for rank, out in enumerate(matrix):
        found = incidents(out["forward_nan"])
        assert [r["step"] for r in found] == [10], found
        incident = found[0]["incident"]
        assert incident["cause"] == "forward" and incident["ranks"] == [1], incident
        if rank == 1:
            assert "the first non-finite output in forward order: blocks.0.ln1" in \
                incident["evidence"], incident["evidence"]
            assert not any("anomaly mode names" in line for line in incident["evidence"])


def test_one_bad_sample_with_nan_gradients_and_a_high_loss_is_skipped_not_rolled_back(matrix):
    """The NaN and the loss spike of the same step are one bad sample: the step is skipped (its
    batch never reaches the weights), not rolled back with an LR cut, and its cause is where the
    NaN was made (backward, on rank 1), not divergence."""
    for rank, out in enumerate(matrix):
        rows = out["bad_sample"]
        found = incidents(rows)
        assert [r["step"] for r in found] == [12], found
        incident = found[0]["incident"]
        assert (incident["signal"], incident["cause"], incident["ranks"]) == (
            "nonfinite_grad", "backward", [1]), incident
        assert found[0]["outcome"] == "skipped", found
        assert all(r["outcome"] != "rolled_back" and r["lr_factor"] == 1.0 for r in rows), rows


def test_a_weight_set_to_1e30_is_named_when_the_loss_turns_nan(matrix):
    for rank, out in enumerate(matrix):
        found = incidents(out["huge_weight"])
        assert [r["step"] for r in found] == [10], found
        incident = found[0]["incident"]
        assert incident["ranks"] == [1], incident
        if rank == 1:
            assert incident["cause"] == "forward", incident
            assert any(line.startswith("parameters hold values above 1e+08 before the step")
                       and line.endswith(": blocks.0.mlp.0.weight (largest 1e+30)")
                       for line in incident["evidence"]), incident["evidence"]
            assert not any("weights are finite" in line for line in incident["evidence"])


def test_an_unchecked_nan_batch_says_the_inputs_were_not_checked(matrix):
    """Nothing claims what was never looked at: without check_inputs() the report says the
    inputs were not checked and its first fix is to check the batch; rank 0, which only
    received the average, points at rank 1's incident (no incident_dir: its log line)."""
    for rank, out in enumerate(matrix):
        found = incidents(out["nan_batch"])
        assert [r["step"] for r in found] == [8], found
        incident = found[0]["incident"]
        assert incident["ranks"] == [1] and incident["cause"] == "forward", incident
        assert not any("inputs are finite" in line or "found the inputs finite" in line
                       for line in incident["evidence"]), incident["evidence"]
        if rank == 1:
            assert any(line.startswith("the inputs were not checked (call check_inputs(batch)")
                       for line in incident["evidence"]), incident["evidence"]
            assert incident["fixes"][0].startswith("check the batch first"), incident["fixes"]
        else:
            assert incident["fixes"] == [
                "read rank 1's incident first (its log line and its report's incident; set "
                "incident_dir to have it written to a file)"], incident["fixes"]


def test_no_false_incident_in_the_first_200_steps(matrix):
    for out in matrix:
        assert not incidents(out["decoder_clean"]), incidents(out["decoder_clean"])
        rows = out["decoder_clean"]
        assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]  # it learnt: the normal early fall
        assert out["gpt2"]["incidents"] == []
        assert out["gpt2"]["last"] < 0.6 * out["gpt2"]["first"]

"""Ranks agree through a process group from Python: real processes (torch.multiprocessing) over
Gloo on loopback, and the demo under torch's own launcher (torchrun) with DDP."""

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stepguard
from conftest import loss_of, make_model

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    group = dist.new_group(list(range(world)))  # any group, not only WORLD
    model = make_model(11)
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       model.named_parameters(), process_group=group,
                                       collective_timeout=60)
    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append((record.levelno, record.getMessage()))

    logging.getLogger("stepguard").addHandler(Lines(logging.DEBUG))
    logging.getLogger("stepguard").setLevel(logging.DEBUG)
    outcomes = []
    evidence = None
    for step in range(6):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        for p in model.parameters():  # data parallel: average the gradients
            dist.all_reduce(p.grad, group=group)
            p.grad /= world
        if step == 3 and rank == 1:
            model[0].bias.grad[0] = float("nan")  # a rank-local fault after the average
        report = guard.step(loss.detach())
        outcomes.append(report.outcome)
        if step == 3:
            assert report.incident["ranks"] == [1]
            assert report.incident["rank_causes"] == {1: "backward"}
            # Every rank's incident names the tensor, though only rank 1's gradient held it.
            assert report.incident["tensors"] == ["0.bias"], report.incident
            evidence = report.incident["evidence"]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save({"outcomes": outcomes, "params": flat, "collectives": guard.stats().collective_calls,
                "step_buffer_bytes": guard.stats().step_buffer_bytes, "lines": lines,
                "evidence": evidence},
               os.path.join(out_dir, "rank%d.pt" % rank))
    dist.destroy_process_group()


def test_every_rank_skips_a_fault_of_one_rank_and_replicas_stay_equal():
    world = 2
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank_main, args=(world, os.path.join(d, "init"), d), nprocs=world,
                           start_method="spawn", join=True)
        results = [torch.load(os.path.join(d, "rank%d.pt" % r)) for r in range(world)]
    expected = ["applied"] * 3 + ["skipped"] + ["applied"] * 2
    for r in results:
        assert r["outcomes"] == expected
        # One at construction (the ranks' layouts), one per step; the incident step adds the
        # per-rank rows, the cause agreement and (the NaN stayed on rank 1) the blamed names.
        assert r["collectives"] == 1 + 6 + 2 + 2
        assert r["step_buffer_bytes"] == 296
    # The one line a torchrun job prints (rank 0's WARNING) carries the tensor and the origin,
    # and rank 0's evidence says what it saw: its own gradients were finite.
    warnings = [text for level, text in results[0]["lines"] if level == logging.WARNING]
    assert warnings == ["step 4: nonfinite_grad -> skip_batch (cause backward; tensors 0.bias; "
                        "ranks 1)"], results[0]["lines"]
    assert results[0]["evidence"][0] == (
        "the fault came from rank 1; on this rank the loss was clean; its own gradients were "
        "finite (the fault stayed on that rank)"), results[0]["evidence"]
    assert torch.equal(results[0]["params"], results[1]["params"])


def test_train_gpt_under_torchrun_with_four_ranks():
    with tempfile.TemporaryDirectory() as d:
        summary_path = os.path.join(d, "summary.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # torch 1.13's launcher under Python 3.11 cannot parse its default "--redirects 0"
        # (enum.Flag no longer iterates the zero member): name a non-zero one.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--redirects", "2", "--tee", "2",
               "--nproc_per_node", "4",
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               os.path.join(ROOT, "integration", "pytorch", "train_gpt.py"),
               "--steps", "40", "--batch-size", "8", "--inject", "nan_grad@10:1",
               "--inject", "nan_loss@20:2", "--summary-json", summary_path]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        with open(summary_path) as f:
            s = json.load(f)
    assert s["ranks"] == 4 and s["steps"] == 40
    assert s["skipped"] == 2 and s["applied"] == 38 and s["rollbacks"] == 0
    assert len(set(s["param_hashes"])) == 1 and s["params_finite"]
    assert [i["step"] for i in s["incidents"]] == [10, 20]
    assert [i["signal"] for i in s["incidents"]] == ["nonfinite_grad", "nonfinite_loss"]
    assert s["final_loss"] < s["initial_loss"]  # it learns


def _dying_rank_main(rank, world, init_file, store_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    model = make_model(12)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), process_group=dist.group.WORLD,
                                       store=dist.FileStore(store_file, world),
                                       collective_timeout=20)
    for step in range(3):
        if step == 2 and rank == 1:
            os._exit(0)  # gone without a word, before the guard's collective of step 3
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        try:
            guard.step(loss.detach())
        except stepguard.ConsensusError as e:
            with open(os.path.join(out_dir, "error%d.txt" % rank), "w") as f:
                f.write("%s|%d|%s|%s" % (isinstance(e, stepguard.StepguardError), e.step,
                                         e.missing_ranks, e))
            os._exit(0)


def test_a_dead_rank_raises_a_consensus_error_naming_it():
    world = 2
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_dying_rank_main,
                                 args=(world, os.path.join(d, "init"), os.path.join(d, "store"),
                                       d),
                                 nprocs=world, start_method="spawn", join=False)
        while not ctx.join(timeout=60):
            pass
        with open(os.path.join(d, "error0.txt")) as f:
            is_stepguard_error, step, missing, message = f.read().split("|", 3)
    assert is_stepguard_error == "True"
    assert step == "3" and missing == "[1]", message
    assert "missing rank 1" in message, message


def _bf16_ddp_rank(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make_model(13).to(torch.bfloat16))
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.module.named_parameters(),
                                       process_group=dist.group.WORLD, collective_timeout=60)
    outcomes = []
    for step in range(4):
        guard.zero_grad()
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(5, 8, generator=g).to(torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        loss.backward()  # DDP averages bf16 gradients over Gloo (torch 2.x; 1.13's Gloo refused)
        if step == 2 and rank == 1:
            model.module[2].weight.grad[0, 0] = float("nan")
        report = guard.step(loss)
        outcomes.append(report.outcome)
        if step == 2:
            assert report.incident["ranks"] == [1]
            if rank == 1:  # blame is rank-local: the rank whose gradient went bad names it
                assert report.incident["tensors"] == ["2.weight"]
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    torch.save({"outcomes": outcomes, "params": flat}, os.path.join(out_dir, "rank%d.pt" % rank))
    dist.destroy_process_group()


def test_bf16_gradients_averaged_by_ddp_over_gloo_are_guarded_on_every_rank():
    world = 2
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_bf16_ddp_rank, args=(world, os.path.join(d, "init"), d), nprocs=world)
        ranks = [torch.load(os.path.join(d, "rank%d.pt" % r)) for r in range(world)]
    for r in ranks:
        assert r["outcomes"] == ["applied", "applied", "skipped", "applied"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


def _no_group_rank(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    model = make_model(14)
    try:
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        message = None
    except ValueError as e:
        message = str(e)
    with open(os.path.join(out_dir, "rank%d.txt" % rank), "w") as f:
        f.write(message or "")
    dist.destroy_process_group()


def test_a_guard_without_a_group_under_several_ranks_is_refused():
    """Each rank would decide alone: one skips a NaN step the other applies."""
    world = 2
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_no_group_rank, args=(world, os.path.join(d, "init"), d), nprocs=world)
        messages = [open(os.path.join(d, "rank%d.txt" % r)).read() for r in range(world)]
    for m in messages:
        assert "torch.distributed runs 2 ranks but the guard was given no process_group" in m
        assert "process_group=dist.group.WORLD" in m


def _stages_main(rank, world, init_file, out_dir):
    """Two ranks holding different parameters, as pipeline stages do: rank 0 two tensors, rank 1
    four. With sharded_gradients every rank's gradients are its own: the norm adds them."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    torch.manual_seed(rank)
    stage = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(rank + 1)])
    names = ["stage%d.%s" % (rank, n) for n, _ in stage.named_parameters()]
    out = {}
    try:
        stepguard.GuardedOptimizer(torch.optim.SGD(stage.parameters(), lr=0.1),
                                   zip(names, stage.parameters()),
                                   process_group=dist.group.WORLD, collective_timeout=30)
    except RuntimeError as e:
        out["refused"] = str(e)
    # Rank 0 says two ranks hold its last gradient; rank 1 holds no part of it (absent). The
    # elements still add up whole (20 + 36 over the copies): the step used to fail on one rank
    # and leave the other waiting for its deadline. Refused when the guards are built.
    Placement = stepguard.Placement
    layout = ([Placement.shard(), Placement.shard(2)] if rank == 0 else
              [Placement.shard()] * 3 + [Placement.absent()])
    try:
        stepguard.GuardedOptimizer(torch.optim.SGD(stage.parameters(), lr=0.1),
                                   zip(names, stage.parameters()), layout=layout,
                                   process_group=dist.group.WORLD, collective_timeout=30)
    except RuntimeError as e:
        out["mismatched"] = str(e)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(stage.parameters(), lr=0.1),
                                       zip(names, stage.parameters()),
                                       process_group=dist.group.WORLD, sharded_gradients=True,
                                       collective_timeout=30)
    steps = []
    for step in range(1, 6):
        guard.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        stage(x).pow(2).mean().backward()
        if (step, rank) in ((2, 0), (4, 1)):
            list(stage.parameters())[-1].grad[0] = float("nan")
        local = sum(float(p.grad.double().pow(2).sum()) for p in stage.parameters())
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        before = [p.detach().clone() for p in stage.parameters()]
        report = guard.step()
        steps.append({"outcome": report.outcome, "grad_norm": report.grad_norm,
                      "expected_norm": float(total.sqrt()), "incident": report.incident,
                      "unchanged": all(torch.equal(a, b)
                                       for a, b in zip(before, stage.parameters()))})
    out["steps"] = steps
    out["collectives"] = guard.stats().collective_calls
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_ranks_holding_different_tensors_skip_a_nan_on_either_and_name_it():
    world = 2
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_stages_main, args=(world, os.path.join(d, "init"), d), nprocs=world,
                           start_method="spawn", join=True)
        results = []
        for r in range(world):
            with open(os.path.join(d, "rank%d.json" % r)) as f:
                results.append(json.load(f))
    for r in results:
        # Replicas (the default) must be alike on every rank: refused at construction, on every
        # rank, with each rank's counts.
        assert "rank 0 holds 2 (20 elements), rank 1 holds 4 (40 elements)" in r["refused"], r
        assert "add up to 4.5 tensors, not a whole number" in r.get("mismatched", ""), r
        steps = r["steps"]
        assert [s["outcome"] for s in steps] == ["applied", "skipped", "applied", "skipped",
                                                 "applied"], steps
        for s in steps:
            if s["outcome"] == "applied":
                assert abs(s["grad_norm"] - s["expected_norm"]) <= 1e-9 * s["expected_norm"], s
            else:
                assert s["unchanged"], s
        # Every rank names the tensor and the rank, whichever rank the NaN was on.
        assert steps[1]["incident"]["tensors"] == ["stage0.0.bias"], steps[1]
        assert steps[1]["incident"]["ranks"] == [0]
        assert steps[3]["incident"]["tensors"] == ["stage1.1.bias"], steps[3]
        assert steps[3]["incident"]["ranks"] == [1]

"""The multi-node shape: the Python demo (DDP + GuardedOptimizer) under two torchrun launchers on
loopback, one per "node" (--nnodes 2 --nproc_per_node 2, c10d rendezvous), as a job on two hosts
starts. Every launcher runs in its own session so a node can be killed whole (agent and workers),
and everything started is killed in a finally block."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TRAIN_GPT = os.path.join(ROOT, "integration", "pytorch", "train_gpt.py")
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
TINY = ["--batch-size", "2", "--context", "16", "--threads", "1"]
COLLECTIVE_TIMEOUT = 10  # seconds (--collective-timeout, also the process group's timeout)
START_DEADLINE = 120  # from the launch to the first steps of every rank (2 cores, 6 processes)
EXIT_DEADLINE = COLLECTIVE_TIMEOUT + 20  # from the kill of node 1 to the end of node 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(node_rank, port, job, rendezvous_host, log_path, train_args):
    """One node: a torchrun agent and its PER_NODE workers, in a session of their own."""
    cmd = [sys.executable, "-m", "torch.distributed.run",
           # Workers' stderr into the agent's log, prefixed by local rank.
           "--redirects", "2", "--tee", "2",
           "--nnodes", str(NODES), "--nproc_per_node", str(PER_NODE),
           "--node_rank", str(node_rank),
           "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:%d" % port, "--rdzv_id", job,
           # Both "nodes" share 127.0.0.1, so say which one hosts the rendezvous store.
           "--rdzv_conf", "is_host=%d" % (node_rank == rendezvous_host),
           "--max_restarts", "0", "--monitor_interval", "1",
           "--log_dir", os.path.join(os.path.dirname(log_path), "torchelastic%d" % node_rank),
           TRAIN_GPT, "--collective-timeout", str(COLLECTIVE_TIMEOUT)] + TINY + train_args
    # LOGLEVEL=INFO: the agent logs the global ranks it was given and its exit barrier.
    env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO")
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


# The workers of each node's agent seen so far, by agent pid. torch 2.x's launcher starts every
# worker in a session of its own, so a node is its agent and the agent's descendants, not one
# process group; they are recorded while the agent lives (a worker orphaned by a killed agent
# has init as its parent).
_WORKERS = {}


def _processes():
    """pid -> (state, parent pid) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry)] = (fields[0], int(fields[1]))
    return out


def _descendants(pid):
    """The live (not zombie) descendants of `pid`, also remembered in _WORKERS."""
    procs = _processes()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (state, parent) in procs.items()
                    if parent in frontier and state != "Z"} - found
        found |= frontier
    _WORKERS.setdefault(pid, set()).update(found)
    return found


def _alive(pids):
    procs = _processes()
    return {p for p in pids if p in procs and procs[p][0] != "Z"}


def _kill_node(proc, sig=signal.SIGKILL):
    """The agent and every worker it started (each in a session of its own under torch 2.x)."""
    pids = _descendants(proc.pid) | _WORKERS.get(proc.pid, set()) | {proc.pid}
    for pid in _alive(pids):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _read(path):
    with open(path, errors="replace") as f:
        return f.read()


def _global_ranks(log_path):
    found = re.search(r"global_ranks=\[([0-9, ]*)\]", _read(log_path))
    return sorted(int(r) for r in found.group(1).split(",")) if found else None


def _trace(path):
    if not os.path.exists(path):
        return []
    lines = _read(path).splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait_until(condition, seconds, what, logs):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("%s: not within %d s\n%s" % (what, seconds, "\n".join(
                "== %s\n%s" % (p, _read(p)[-3000:]) for p in logs)))
        time.sleep(0.2)


def _two_nodes(d, rendezvous_host, train_args, nodes):
    """Starts both nodes into `nodes` (the caller kills them); returns their logs."""
    port, job = _free_port(), "stepguard-%d" % os.getpid()
    logs = [os.path.join(d, "node%d.log" % n) for n in range(NODES)]
    for n in range(NODES):  # node 0 first: the rendezvous orders agents by pid on one host
        nodes.append(_launch(n, port, job, rendezvous_host, logs[n], train_args))
    return logs


def test_two_nodes_skip_the_same_step_on_every_rank_and_end_with_equal_parameters():
    with tempfile.TemporaryDirectory() as d:
        trace, summary_path = os.path.join(d, "trace.jsonl"), os.path.join(d, "summary.json")
        nodes = []
        try:
            logs = _two_nodes(d, 0, [
                "--steps", "8", "--inject", "nan_grad@3:3", "--inject", "nan_loss@6:1",
                "--trace", trace, "--summary-json", summary_path], nodes)
            for node, log in zip(nodes, logs):
                try:
                    rc = node.wait(START_DEADLINE + 60)
                except subprocess.TimeoutExpired:
                    pytest.fail("node %s did not finish\n%s" % (log, _read(log)[-4000:]))
                assert rc == 0, _read(log)[-4000:]
            placement = [_global_ranks(log) for log in logs]
            with open(summary_path) as f:
                summary = json.load(f)
            traces = [_trace("%s.rank%d" % (trace, r)) for r in range(WORLD)]
        finally:
            for node in nodes:
                _kill_node(node)
    # Each node ran two of the four ranks.
    assert sorted(placement, key=str) == [[0, 1], [2, 3]], placement
    # The fault of one rank on one node is skipped on every rank of both nodes.
    for rank, records in enumerate(traces):
        outcomes = {rec["step"]: rec["outcome"] for rec in records}
        assert outcomes == {s: "skipped" if s in (3, 6) else "applied" for s in range(1, 9)}, rank
        by_step = {rec["step"]: rec for rec in records}
        assert by_step[3]["faulty_ranks"] == [3] and by_step[3]["signals"] == ["nonfinite_grad"]
        assert "nonfinite_loss" in by_step[6]["signals"]
    assert summary["ranks"] == WORLD and summary["steps"] == 8
    assert summary["skipped"] == 2 and summary["applied"] == 6 and summary["rollbacks"] == 0
    assert [i["step"] for i in summary["incidents"]] == [3, 6]
    # Equal parameters on all four ranks: each rank's digest, gathered by rank 0.
    assert len(summary["param_hashes"]) == WORLD and len(set(summary["param_hashes"])) == 1
    assert summary["params_finite"]


# What a worker of the surviving node prints: the guard's failed step collective, naming the
# dead ranks through the job's store; or, when the kill lands in backward, the gradient
# all-reduce of DDP (the same Gloo group, and before the guard's collective in every step).
GUARD_FAILED = (r"stepguard: rank %%d: the step \d+ all-reduce over gloo \(%d ranks, deadline "
                r"%d ms\) failed; missing ranks %%s \(" % (WORLD, COLLECTIVE_TIMEOUT * 1000))
DDP_FAILED = r"Connection (closed|reset) by peer"
BARRIER = r"Waiting \d+ seconds for other agents to finish"


def _start_then_kill_node_1(d, rendezvous_host, nodes):
    """Both nodes into `nodes`; once every rank has stepped, node 1 is killed whole (SIGKILL to
    its agent and workers). Returns the logs, node 1's global ranks and the time of the kill."""
    trace = os.path.join(d, "trace.jsonl")
    logs = _two_nodes(d, rendezvous_host, ["--steps", "5000", "--trace", trace], nodes)
    _wait_until(lambda: all(len(_trace("%s.rank%d" % (trace, r))) >= 3 for r in range(WORLD)),
                START_DEADLINE, "every rank stepping", logs)
    dead_ranks = _global_ranks(logs[1])
    assert dead_ranks and len(dead_ranks) == PER_NODE, _read(logs[1])[-4000:]
    assert len(_descendants(nodes[0].pid)) >= PER_NODE  # node 0's workers, for _wait_workers_gone
    _kill_node(nodes[1])
    return logs, dead_ranks, time.monotonic()


def _worker_output(output, local_rank):
    prefix = "[default%d]:" % local_rank
    return "\n".join(line for line in output.splitlines() if line.startswith(prefix))


def _wait_workers_gone(agent, log, seconds):
    """Node 0's workers (recorded while they ran, orphaned or not) have all exited."""
    workers = set(_WORKERS.get(agent.pid, set()))
    assert workers, "node 0's workers were not recorded"
    _wait_until(lambda: not _alive(workers), seconds, "node 0's workers exiting", [log])


def test_a_killed_node_fails_the_other_nodes_step_naming_its_ranks():
    """The usual shape: the rendezvous endpoint on node 0, node 1 dies."""
    with tempfile.TemporaryDirectory() as d:
        nodes = []
        try:
            logs, dead_ranks, killed_at = _start_then_kill_node_1(d, 0, nodes)
            agent, log = nodes[0], logs[0]
            _wait_workers_gone(agent, log, EXIT_DEADLINE)
            workers_done = time.monotonic() - killed_at
            # torch 1.13's agent then waits in its exit barrier for the dead agent (300 s, not
            # settable from torchrun, in a store call that a SIGTERM does not interrupt): the
            # job's scheduler ends it. Later agents may exit at once.
            _wait_until(lambda: agent.poll() is not None or re.search(BARRIER, _read(log)),
                        EXIT_DEADLINE, "node 0's agent exiting or in its exit barrier", [log])
            output = _read(log)
        finally:
            for node in nodes:
                _kill_node(node)
    assert workers_done < EXIT_DEADLINE
    assert agent.returncode in (None, 1), output[-4000:]
    # A worker of node 0 failed on a collective with the dead node and exited 1; torch 2.x's
    # agent then stops the other worker (SIGTERM), which may not have reached its own deadline.
    named = ", ".join(str(r) for r in dead_ranks)
    said = [re.search(GUARD_FAILED % (rank, named), _worker_output(output, local))
            or re.search(DDP_FAILED, _worker_output(output, local))
            for local, rank in enumerate(sorted(set(range(WORLD)) - set(dead_ranks)))]
    assert any(said), output[-4000:]
    assert all(said) or re.search(r"Sending process \d+ closing signal SIGTERM", output), \
        output[-4000:]
    assert re.search(r"failed \(exitcode: 1\) local_rank: \d", output), output[-4000:]


def test_a_killed_node_that_hosted_the_rendezvous_ends_the_other_node():
    """The rendezvous store dies with node 1: node 0's agent stops by itself."""
    with tempfile.TemporaryDirectory() as d:
        nodes = []
        try:
            logs, dead_ranks, killed_at = _start_then_kill_node_1(d, 1, nodes)
            agent, log = nodes[0], logs[0]
            try:
                rc = agent.wait(EXIT_DEADLINE)
            except subprocess.TimeoutExpired:
                pytest.fail("node 0's agent did not exit\n%s" % _read(log)[-4000:])
            agent_done = time.monotonic() - killed_at
            _wait_workers_gone(agent, log, EXIT_DEADLINE - agent_done)
            workers_done = time.monotonic() - killed_at
            output = _read(log)
        finally:
            for node in nodes:
                _kill_node(node)
    assert rc == 1 and max(agent_done, workers_done) < EXIT_DEADLINE, output[-4000:]
    # A worker that failed first says why; the agent may have stopped the others on finding the
    # rendezvous store gone, which it says.
    named = ", ".join(str(r) for r in dead_ranks)
    said = [re.search(GUARD_FAILED % (rank, named), _worker_output(output, local))
            or re.search(DDP_FAILED, _worker_output(output, local))
            for local, rank in enumerate(sorted(set(range(WORLD)) - set(dead_ranks)))]
    assert any(said) or "RendezvousConnectionError" in output, output[-4000:]

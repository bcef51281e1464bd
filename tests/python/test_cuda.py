"""The guard on a GPU: model, batch and guard on cuda:0 under bf16 autocast; a NaN gradient is
skipped and a loss spike rolled back, as on the CPU. Skipped (with the reason) where torch sees no
GPU; benchmarks/gpu_check.sh runs it on the GPU machine."""

import torch

import stepguard

try:  # the GPU machine may have no pytest: gpu_check.sh then calls the test directly
    import pytest
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                    reason="no CUDA device visible to torch (run on a GPU machine)")
except ImportError:
    pass

POLICY = """version: 1
checkpoint: {snapshot_every: 1, snapshot_keep: 2}
detectors:
  loss_spike: {warmup: 100, early_factor: 10, early_after: 3}
rules:
  - {on: nonfinite, action: skip_batch}
  - {on: loss_spike, action: rollback, skip_batches: 1}
"""


def test_bf16_autocast_on_cuda_skips_a_nan_and_rolls_back_a_spike():
    device = torch.device("cuda:0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8)).to(device)
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       model.named_parameters(), policy_yaml=POLICY)
    g = torch.Generator(device=device).manual_seed(1)
    snapshots = {}
    outcomes = []
    for step in range(1, 11):
        guard.zero_grad()
        x = torch.randn(16, 32, device=device, generator=g)
        y = torch.randn(16, 8, device=device, generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step == 8:
            loss = loss * 1000.0  # a spike after the warm-up of 3 values
        loss.backward()
        if step == 5:
            model[2].weight.grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        report = guard.step(loss)
        outcomes.append(report.outcome)
        if step == 5:
            assert report.incident["tensors"] == ["2.weight"]
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        if step == 8:
            want = snapshots[report.rolled_back_to]
            assert all(torch.equal(a, b) for a, b in zip(want, model.parameters()))
        snapshots[step] = [p.detach().clone() for p in model.parameters()]
    assert outcomes[4] == "skipped" and outcomes[7] == "rolled_back"
    assert outcomes.count("applied") == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())


# The deferred verdict's acceptance: no host read or wait in a steady-state step (no snapshot
# due), checked by torch's sync debug mode as "error"; and the synchronous verdict's one read.
STEADY = """version: 1
checkpoint: {snapshot_every: 1000}
rules:
  - {on: nonfinite, action: skip_batch}
"""


def _cuda_loop(deferred, steps, sync_mode="default"):
    """A steady-state loop of `steps` guarded steps (after 3 warm-up steps); returns the guard
    and the CUDA runtime calls that made the host wait, as torch.profiler recorded them."""
    device = torch.device("cuda:0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256)).to(device)
    guard = stepguard.GuardedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model.named_parameters(),
        policy_yaml=STEADY, deferred=deferred)
    x = torch.randn(64, 256, device=device)

    def one():
        guard.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        guard.step(loss.detach())
    for _ in range(3):  # warm-up: the first steps allocate and decide nothing yet
        one()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        torch.cuda.set_sync_debug_mode(sync_mode)  # "error": a synchronizing call raises
        try:
            for _ in range(steps):
                one()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [e.name for e in prof.events()
             if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    return guard, waits


def test_the_deferred_verdict_makes_no_host_read_in_a_steady_state_step_on_cuda():
    guard, waits = _cuda_loop(True, 100, "error")
    assert waits == []
    assert guard.flush().deferred


def test_the_synchronous_verdict_makes_one_host_read_per_step_on_cuda():
    _, waits = _cuda_loop(False, 20)
    assert len(waits) == 20, waits[:5]


def _framework_sequence(device, steps, sync_mode=None):
    """The deferred verdict as torchtitan's GuardedTrainer drives it, without torchtitan: an AdamW
    fused in every param group (as torchtitan builds it), the previous step decided after this
    step's backward, this step begun, torch's clip_grads_with_norm_ from the agreed norm on the
    device, the update gated by the device flag. Returns the guard and its reports."""
    from stepguard import _deferred
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256)).to(device)
    groups = [{"params": [p], "fused": True} for p in model.parameters()]
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(groups, lr=1e-3),
                                       model.named_parameters(), policy_yaml=STEADY,
                                       deferred=True)
    x = torch.randn(64, 256, device=device)
    reports = []

    def one():
        guard.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        reports.append(_deferred.resolve(guard, batch_in_hand=True))
        found_inf, lr_factor = guard._guard.begin_deferred(loss.detach())
        norm = guard._guard.deferred_grad_norm()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.5, norm, foreach=True)
        _deferred.gated_apply(guard, found_inf, lr_factor)
    for _ in range(3):
        one()
    if sync_mode is not None:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(sync_mode)
    try:
        for _ in range(steps):
            one()
    finally:
        if sync_mode is not None:
            torch.cuda.set_sync_debug_mode("default")
    return guard, reports


def test_the_deferred_clip_from_the_agreed_norm_makes_no_host_read_on_cuda():
    guard, reports = _framework_sequence(torch.device("cuda:0"), 100, "error")
    assert [r.outcome for r in reports[1:]] == ["applied"] * 102
    assert all(r.deferred for r in reports[1:]) and guard.flush().deferred

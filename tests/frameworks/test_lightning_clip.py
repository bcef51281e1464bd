"""The real Lightning's gradient clip (Trainer(gradient_clip_val=...), one process) with the
StepguardCallback: the verdict before the clip, the clip from the agreed norm, and with
``framework_norm=True`` Lightning's own norm and clip, bitwise an unguarded run."""

import pytest
import torch

from test_lightning import CLIP, NAN_STEP, clipped_fit


def test_lightning_gradient_clip_comes_after_the_verdict_and_uses_its_norm(tmp_path,
                                                                           monkeypatch):
    """Trainer(gradient_clip_val=...), Lightning's usual setting: the guard judges the gradients
    before the clip (blame names the one NaN tensor, the norm reported is the pre-clip norm
    Lightning's own grad_norm gives), and the clip uses the guard's norm: the parameters are
    those of an unguarded run with the same clip. No per-step stats() call (it would wait for
    the step's snapshot copy)."""
    from stepguard.integrations import lightning as integration

    torch.set_num_threads(1)
    calls = []
    stats = integration._LightningGuard.stats
    monkeypatch.setattr(integration._LightningGuard, "stats",
                        lambda self: calls.append(1) or stats(self))
    norms = []  # torch's norm functions (Lightning's clip by norm calls clip_grad_norm_)
    for name in ("get_total_norm", "clip_grad_norm_"):
        monkeypatch.setattr(torch.nn.utils, name, lambda *a, _f=getattr(torch.nn.utils, name),
                            _n=name, **k: norms.append(_n) or _f(*a, **k))
    guard_cb = integration.StepguardCallback(policy="default")
    guarded = clipped_fit(tmp_path, 5, [guard_cb])
    guard = guard_cb.guards[0]
    assert len(calls) <= 2, len(calls)  # at fit start only, not per step
    # Per step: the guard's one collective, and no second norm.
    assert norms == [] and guard.stats().collective_calls == 5, (norms, guard.stats())
    (incident,) = guard_cb.incidents
    assert incident["step"] == NAN_STEP + 1 and incident["tensors"] == ["head.weight"], incident
    assert guard.stats().totals.to_dict()["skipped"] == 1
    assert torch.equal(guarded.after[NAN_STEP], guarded.after[NAN_STEP - 1])
    plain = clipped_fit(tmp_path, NAN_STEP, [])
    for step in range(NAN_STEP):
        # The reported norm is the one before the clip, above the clip value, Lightning's own.
        assert guarded.norms[step] > CLIP
        assert guarded.reported[step] == pytest.approx(guarded.norms[step], rel=1e-6)
        assert guarded.norms[step] == pytest.approx(plain.norms[step], rel=1e-6)
        assert torch.allclose(guarded.after[step], plain.after[step], rtol=0, atol=1e-7)
    assert all(torch.isfinite(p).all() for p in guarded.after)


def test_lightning_framework_norm_is_lightnings_own_clip_bitwise(tmp_path):
    """StepguardCallback(framework_norm=True) with a binding gradient_clip_val: Lightning computes
    its own norm and clips with it, so every applied step is bitwise an unguarded run's; the NaN
    step is skipped all the same."""
    from stepguard.integrations.lightning import StepguardCallback

    torch.set_num_threads(1)
    guard_cb = StepguardCallback(policy="default", framework_norm=True)
    guarded = clipped_fit(tmp_path, NAN_STEP + 1, [guard_cb])
    plain = clipped_fit(tmp_path, NAN_STEP, [])
    for step in range(NAN_STEP):
        assert guarded.norms[step] > CLIP
        assert torch.equal(guarded.after[step], plain.after[step]), step
    assert guard_cb.guards[0].stats().totals.to_dict()["skipped"] == 1
    assert torch.equal(guarded.after[NAN_STEP], guarded.after[NAN_STEP - 1])
    with pytest.raises(TypeError, match="framework_norm must be a bool"):
        StepguardCallback(framework_norm="yes")


def test_lightning_with_the_guard_off_is_lightnings_own_step_bitwise(tmp_path):
    """StepguardCallback(enabled=False): every step is Lightning's own (its norm, its clip), the
    NaN step applied as an unguarded run applies it, bit for bit; no collective."""
    from stepguard.integrations.lightning import StepguardCallback

    torch.set_num_threads(1)
    guard_cb = StepguardCallback(policy="default", enabled=False)
    off = clipped_fit(tmp_path, NAN_STEP + 1, [guard_cb])
    plain = clipped_fit(tmp_path, NAN_STEP + 1, [])
    for step in range(NAN_STEP + 1):
        assert torch.equal(off.after[step].view(torch.int32), plain.after[step].view(torch.int32))
    assert not torch.isfinite(off.after[NAN_STEP]).all()  # the guard looked at nothing
    stats = guard_cb.guards[0].stats()
    assert stats.totals.to_dict()["applied"] == NAN_STEP + 1 and stats.collective_calls == 0

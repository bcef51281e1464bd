"""The step the frameworks call: step(), step(closure), record_loss, zero_grad(set_to_none=True),
parameters without gradients, and the options as one type. Expected values come from the plain
optimizer's own steps."""

import datetime
import json
import os

import pytest
import torch

import stepguard
from conftest import loss_of, make_model
from stepguard._port import TorchOptimPort


def _pair(seed=1, lr=1e-2):
    a, b = make_model(seed), make_model(seed)
    plain = torch.optim.AdamW(a.parameters(), lr=lr)
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(b.parameters(), lr=lr),
                                       b.named_parameters())
    return a, plain, b, guard


def _equal(m1, m2):
    return all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


def test_step_without_a_loss_guards_the_gradients_and_says_it_saw_no_loss(tmp_path):
    a, plain, b, _ = _pair()
    trace = tmp_path / "trace.jsonl"
    guard = stepguard.GuardedOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-2),
                                       b.named_parameters(), trace_path=str(trace))
    for step in range(3):
        plain.zero_grad()
        loss_of(a, step).backward()
        plain.step()
        guard.zero_grad()
        loss_of(b, step).backward()
        report = guard.step()
        assert report.applied and report.loss is None and not report.loss_given
        assert report.grad_norm > 0
    assert _equal(a, b)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["loss"] for line in lines] == [None, None, None]
    assert all(line["loss_given"] is False and line["loss_nonfinite_ranks"] == 0
               for line in lines)
    # A NaN gradient is still caught without a loss.
    guard.zero_grad()
    loss_of(b, 9).backward()
    b[0].weight.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in b.parameters()]
    report = guard.step()
    assert report.skipped and report.incident["tensors"] == ["0.weight"]
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))


def test_a_loss_given_to_the_step_is_reported():
    _, _, b, guard = _pair()
    loss = loss_of(b, 0)
    loss.backward()
    report = guard.step(loss)
    assert report.loss_given and report.loss == pytest.approx(loss.item(), rel=1e-12)


def test_record_loss_feeds_the_next_step_only():
    _, _, b, guard = _pair()
    loss = loss_of(b, 0)
    loss.backward()
    guard.record_loss(loss)
    first = guard.step()
    assert first.loss_given and first.loss == pytest.approx(loss.item(), rel=1e-12)
    guard.zero_grad()
    loss_of(b, 1).backward()
    second = guard.step()
    assert not second.loss_given and second.loss is None


def test_a_recorded_nan_loss_is_skipped():
    _, _, b, guard = _pair()
    loss = loss_of(b, 0)
    loss.backward()
    guard.record_loss(loss * float("nan"))
    before = [p.detach().clone() for p in b.parameters()]
    report = guard.step()
    assert report.skipped and report.incident["signal"] == "nonfinite_loss"
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))


@pytest.mark.parametrize("bad, error", [
    (3.0, TypeError), (torch.ones(2), ValueError), (torch.tensor(1), ValueError)])
def test_record_loss_refuses_what_is_not_a_loss(bad, error):
    _, _, _, guard = _pair()
    with pytest.raises(error, match="record_loss"):
        guard.record_loss(bad)


def test_step_with_a_closure_matches_the_plain_optimizer_and_returns_its_loss():
    a, plain, b, guard = _pair()
    calls = []
    for step in range(3):
        def plain_closure(step=step):
            plain.zero_grad()
            loss = loss_of(a, step)
            loss.backward()
            return loss

        def closure(step=step):
            calls.append(torch.is_grad_enabled())
            guard.zero_grad()
            loss = loss_of(b, step)
            loss.backward()
            return loss

        expected = plain.step(plain_closure)
        with torch.no_grad():  # a framework may call step() under no_grad; the closure needs grad
            report = guard.step(closure)
        assert report.applied and report.loss == pytest.approx(expected.item(), rel=1e-12)
    assert calls == [True, True, True]
    assert _equal(a, b)


def test_a_closure_that_raises_or_returns_no_tensor_changes_nothing():
    _, _, b, guard = _pair()
    before = [p.detach().clone() for p in b.parameters()]

    def raises():
        raise RuntimeError("the batch is gone")

    with pytest.raises(RuntimeError, match="the batch is gone"):
        guard.step(raises)

    def returns_a_float():
        loss = loss_of(b, 0)
        loss.backward()
        return loss.item()

    with pytest.raises(TypeError, match="closure must return this step's loss tensor.*float"):
        guard.step(returns_a_float)
    with pytest.raises(TypeError, match="takes the loss tensor, a closure or nothing, got float"):
        guard.step(1.5)
    assert guard.stats().step_count == 0 and guard.stats().collective_calls == 0
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))


def test_zero_grad_sets_gradients_to_none_by_default_and_none_gradients_are_fine():
    _, _, b, guard = _pair()
    loss_of(b, 0).backward()
    guard.zero_grad()
    assert all(p.grad is None for p in b.parameters())
    loss_of(b, 0).backward()
    guard.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in b.parameters())
    # Only the last layer gets a gradient: the others stay None and the step is fine.
    guard.zero_grad()
    b[2].weight.sum().backward()
    assert b[0].weight.grad is None
    before = b[0].weight.detach().clone()
    report = guard.step()
    assert report.applied and report.grad_norm == pytest.approx(
        torch.ones_like(b[2].weight).norm().item(), rel=1e-12)
    assert torch.equal(b[0].weight, before)


def test_options_are_one_type_spelled_as_in_cpp():
    fields = stepguard.GuardOptions.fields
    assert "policy" in fields and "collective_timeout" in fields and "policy_file" not in fields
    o = stepguard.GuardOptions()
    assert o.collective_timeout == 300.0 and o.metrics_port == -1 and o.policy == ""
    o.collective_timeout = datetime.timedelta(seconds=2.5)
    assert o.collective_timeout == 2.5
    model = make_model(0)
    with pytest.raises(TypeError, match=r"unknown option polcy \(did you mean policy\?\)"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), polcy="x")
    with pytest.raises(TypeError, match=r"unknown option metrics_prot \(did you mean metrics_port"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), metrics_prot=0)
    with pytest.raises(TypeError, match="option metrics_port must be an int, got bool"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), metrics_port=True)
    with pytest.raises(ValueError, match="collective_timeout must be more than 0 and at most a yea"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   collective_timeout=1e300)
    with pytest.raises(TypeError, match="option loss_scaling must be True or False, got NoneType"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scaling=None)


def test_a_preset_is_accepted_by_name():
    model = make_model(0)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), policy="default")
    loss = loss_of(model, 0)
    loss.backward()
    assert guard.step(loss).applied
    with pytest.raises(stepguard.StepguardError,
                       match="policy 'defualt' is neither a file nor a shipped preset "
                             r"\(did you mean 'default'\?\) \(presets: debug-strict, deepspeed-fp16, default, megatron, "
                             r"palm-rollback\)"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy="defualt")


def test_a_trace_path_in_a_folder_not_made_yet_is_made_as_incident_dirs_is(tmp_path):
    model = make_model(0)
    trace = tmp_path / "runs" / "one" / "trace.jsonl"
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), trace_path=str(trace),
                                       trace_every_step=True)
    loss = loss_of(model, 0)
    loss.backward()
    assert guard.step(loss).applied
    del guard
    assert json.loads(trace.read_text().splitlines()[0])["step"] == 1


def test_the_policy_tools_take_preset_names_and_print_the_presets(tmp_path):
    presets = stepguard.policy_presets()
    assert sorted(presets) == ["debug-strict", "deepspeed-fp16", "default", "megatron",
                               "palm-rollback"]
    assert presets["palm-rollback"].startswith("# The PaLM paper's remedy")  # the YAML, commented
    assert stepguard.check_policy_file("palm-rollback") == []
    assert "Rules, checked in this order" in stepguard.explain_policy_file("default")
    # A preset's text is a policy file of one's own to start from.
    mine = tmp_path / "mine.yaml"
    mine.write_text(presets["megatron"])
    assert stepguard.check_policy_file(str(mine)) == []
    # An invalid policy is the guard's error, as GuardedOptimizer raises it (it was ValueError).
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nlimits: {bogus: 1}\n")
    with pytest.raises(stepguard.StepguardError, match=r"bad.yaml:2:10: unknown key 'bogus'"):
        stepguard.explain_policy_file(str(bad))
    with pytest.raises(stepguard.StepguardError,
                       match=r"defualt: no policy file of that name and no shipped preset "
                             r"\(did you mean 'default'\?\)"):
        stepguard.explain_policy_file("defualt")


def test_the_version_names_the_package_and_the_libtorch_it_was_built_against():
    import re
    import subprocess
    assert stepguard.__version__ == "0.1.0"  # the project version (CMakeLists.txt, setup.py)
    build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(stepguard.__file__))))
    cli = os.path.join(build, "bin", "stepguard")
    if not os.path.exists(cli):
        pytest.skip("no stepguard binary beside this package (an installed package)")
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True).stdout
    assert re.match(r"stepguard 0\.1\.0 libtorch 2\.\d+\.\d+", out), out
    assert out.split()[3] == torch.__version__.split("+")[0]  # the torch this Python runs


def test_verdict_the_loops_update_and_settle_are_a_step_and_misuse_is_refused():
    a, plain, b, guard = _pair(seed=4)
    for step in range(3):
        plain.zero_grad()
        loss_of(a, step).backward()
        plain.step()
        guard.zero_grad()
        loss = loss_of(b, step)
        loss.backward()
        verdict = guard.verdict(loss)
        assert isinstance(verdict, stepguard.Verdict)
        assert verdict.step == step + 1 and verdict.applies and verdict.lr_factor == 1.0
        assert verdict.clip_norm is None and verdict.loss == pytest.approx(loss.item())
        guard.optimizer.step()  # the loop's own update
        report = guard.settle(verdict, True)
        assert report.applied and report.grad_norm == verdict.grad_norm
    assert _equal(a, b)
    guard.zero_grad()
    loss = loss_of(b, 9)
    loss.backward()
    verdict = guard.verdict(loss)
    with pytest.raises(RuntimeError, match="waits for its settle"):
        guard.verdict(loss)
    with pytest.raises(RuntimeError, match="waits for its settle"):
        guard.step(loss)
    with pytest.raises(TypeError, match="applied must be a bool"):
        guard.settle(verdict, 1)
    before = [p.detach().clone() for p in b.parameters()]
    report = guard.settle(verdict, False)  # the update raised: a skipped step, nothing changed
    assert report.skipped and all(torch.equal(x, y) for x, y in zip(before, b.parameters()))
    with pytest.raises(RuntimeError, match="settle\\(\\) without a verdict"):
        guard.settle(verdict, True)
    assert guard.stats().totals.skipped == 1 and guard.stats().step_count == 4


def test_a_layout_is_checked_where_it_is_given():
    model = make_model(5)
    params = list(model.parameters())
    with pytest.raises(TypeError, match="layout\\[1\\] is str, not a stepguard.Placement"):
        stepguard.GuardedOptimizer(torch.optim.SGD(params, lr=0.1), layout=[
            stepguard.Placement.replica(), "shard"])
    with pytest.raises(RuntimeError, match="2 placements for %d parameters" % len(params)):
        stepguard.GuardedOptimizer(torch.optim.SGD(params, lr=0.1),
                                   layout=[stepguard.Placement.replica()] * 2)
    with pytest.raises(RuntimeError, match="set it in one place"):
        stepguard.GuardedOptimizer(torch.optim.SGD(params, lr=0.1), sharded_gradients=True,
                                   layout=[stepguard.Placement.shard()] * len(params))
    p = stepguard.Placement.replicated(4)
    assert (p.kind, p.copies, repr(p)) == ("replicated", 4, "Placement.replicated(4)")
    assert stepguard.Placement.shard() == stepguard.Placement.shard(1)


def test_parameters_where_named_parameters_go_is_a_clear_type_error():
    model = make_model(0)
    with pytest.raises(TypeError, match=r"named_parameters must give \(name, parameter\) pairs, "
                                        r"as model.named_parameters\(\) does; got a tensor "
                                        r"\(model.parameters\(\)\?"):
        stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.parameters())


def test_a_reports_repr_says_what_happened_and_where():
    model = make_model(0)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    loss = loss_of(model, 0)
    loss.backward()
    clean = repr(guard.step(loss))
    assert clean.startswith("StepReport(step=1, outcome='applied', action='apply', loss="), clean
    assert "grad_norm=" in clean and "incident" not in clean
    guard.zero_grad()
    loss = loss_of(model, 1)
    loss.backward()
    model[0].weight.grad[0, 0] = float("nan")
    bad = repr(guard.step(loss))
    assert "outcome='skipped', action='skip_batch'" in bad, bad
    assert "nonfinite_count=1" in bad and "incident=nonfinite_grad/" in bad, bad
    assert " in 0.weight" in bad, bad


def test_help_of_guard_options_gives_each_options_type_and_default():
    docs = {name: getattr(stepguard.GuardOptions, name).__doc__
            for name in stepguard.GuardOptions.fields}
    assert docs["policy"].startswith("str (or a path), default ''"), docs["policy"]
    assert docs["max_consecutive_bad_steps"].startswith("int, default 0")
    assert docs["loss_scaling"].startswith("bool, default False")
    assert docs["process_group"].startswith("ProcessGroup or None, default None")
    assert docs["collective_timeout"].startswith("seconds or timedelta, default ")
    assert all("default" in d and "GuardOptions::" in d for d in docs.values()), docs


class _FrameworkScaled(TorchOptimPort):
    """A port whose framework owns a loss scale: ``given`` is what framework_loss_scale()
    returns each step."""

    given = None

    def framework_loss_scale(self):
        return self.given


@pytest.mark.parametrize("scaled", [True, False])
def test_a_frameworks_scale_unscales_the_gradients_it_says_are_scaled_and_makes_inf_overflow(
        scaled):
    """framework_loss_scale() -> (scale, floor) or (scale, floor, gradients_scaled): with
    gradients_scaled (the default, DeepSpeed's) the guard reads the gradients divided by the
    scale; without (GradScaler's unscale_, Megatron's prepare_grads ran) as they are. Either way
    the report's loss_scale is the framework's, an Inf gradient of a finite loss is an overflow
    while the scale is above its floor (only skipped), and one at the floor goes by the
    policy."""
    model = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    port = _FrameworkScaled(opt, model.named_parameters())
    guard = stepguard.GuardedOptimizer(opt, port=port, policy="default")
    model.weight.grad = torch.full((1, 4), 3.0 * (1024.0 if scaled else 1.0))
    port.given = (1024.0, 1.0) if scaled else (1024.0, 1.0, False)
    report = guard.step(torch.tensor(0.5))
    assert report.applied and report.loss_scale == 1024.0
    assert report.grad_norm == pytest.approx(6.0)  # |(3, 3, 3, 3)|, unscaled
    model.weight.grad = torch.tensor([[float("inf"), 1.0, 1.0, 1.0]])
    report = guard.step(torch.tensor(0.5))
    assert report.outcome == "skipped" and report.incident["signal"] == "overflow", report
    port.given = (1.0, 1.0, False)  # at the floor: the scale cannot fix it
    model.weight.grad = torch.tensor([[float("inf"), 1.0, 1.0, 1.0]])
    report = guard.step(torch.tensor(0.5))
    assert report.incident["signal"] == "nonfinite_grad", report


@pytest.mark.parametrize("bad", [(1.0,), (1.0, 1.0, True, 4), (0.0, 1.0), (float("inf"), 1.0)])
def test_a_ports_framework_scale_that_is_not_one_is_a_clear_error(bad):
    model = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    port = _FrameworkScaled(opt, model.named_parameters())
    port.given = bad
    guard = stepguard.GuardedOptimizer(opt, port=port, policy="default")
    model.weight.grad = torch.ones(1, 4)
    before = model.weight.detach().clone()
    with pytest.raises(Exception, match="framework_loss_scale"):
        guard.step(torch.tensor(0.5))
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("preset", ["megatron", "deepspeed-fp16"])
def test_a_presets_loss_scale_section_is_the_frameworks_under_a_frameworks_port(preset):
    """Inside a framework (its port has framework_loss_scale) a preset's loss_scale section turns
    no scaler of the guard's on: bf16/fp32 (no framework scale) steps exactly as the plain
    optimizer, not 2^-32 smaller; loss_scaling=True is refused, naming why."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    plain = torch.nn.Linear(4, 1, bias=False)
    plain.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    port = _FrameworkScaled(opt, model.named_parameters())
    guard = stepguard.GuardedOptimizer(opt, port=port, policy=preset)
    for m in (model, plain):
        m.weight.grad = torch.ones(1, 4)
    report = guard.step(torch.tensor(0.5))
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    assert report.applied and report.loss_scale == 1.0 and report.grad_norm == pytest.approx(2.0)
    assert torch.equal(model.weight, plain.weight)
    with pytest.raises(Exception, match="leave loss_scaling off"):
        stepguard.GuardedOptimizer(opt, port=_FrameworkScaled(opt, model.named_parameters()),
                                   loss_scaling=True)

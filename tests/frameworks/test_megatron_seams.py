"""The Megatron integration's declared seams with the real Megatron-core (CPU, Gloo, one rank,
bf16 with Megatron's DDP, and the distributed optimizer): GuardedMegatronOptimizer writes
nothing on Megatron's objects (every attribute that differs after guarded steps differs in an
unguarded twin after the same steps too); a Megatron function the guarded step relies on that
changed (a modified copy put in its place) is refused, naming it and what it is for, and runs
with a warning under ``allow_untested_framework=True``; a release without
``_copy_main_params_to_model_params`` is refused even then (a rollback needs it); parameters in
one of Megatron 0.19's separate grad-norm groups and Megatron-FSDP are refused."""

import json
import os
import warnings

import torch
import torch.distributed as dist

import megatron.core  # noqa: F401  (a missing Megatron-core fails the test)
from conftest import POLICY, spawn_ranks
from test_megatron import _build, train_steps

STEPS = 3


def _train(model, config, optimizer, steps=STEPS):
    return train_steps(model, config, optimizer, steps)


def _objects(model, config, megatron_optimizer):
    """Megatron's objects the guarded optimizer is given or reaches, by a stable name."""
    from stepguard.integrations.megatron import _inner_optimizers
    out = {"model": model, "module": model.module, "config": config,
           "ddp_config": model.ddp_config, "optimizer": megatron_optimizer}
    for i, inner in enumerate(_inner_optimizers(megatron_optimizer)):
        out["inner%d" % i] = inner
        out["inner%d.config" % i] = inner.config
        out["inner%d.optimizer" % i] = inner.optimizer
    for name, p in model.module.named_parameters():
        out["param:" + name] = p
    return out


def _identities(objects):
    return {key: {name: id(value) for name, value in vars(obj).items()}
            for key, obj in objects.items()}


def _changed(before, after):
    return {key: {name for name in set(before[key]) | set(after[key])
                  if before[key].get(name) != after[key].get(name)} for key in before}


def _writes_nothing(distributed_optimizer):
    """The attributes the guard changed beyond what Megatron's own steps change (none may be),
    and whether the guarded run's parameters are the twin's (no clip binds: bitwise)."""
    from stepguard.integrations.megatron import GuardedMegatronOptimizer
    runs = {}
    for guarded in (False, True):
        model, config, megatron_optimizer = _build("bf16", distributed_optimizer)
        objects = _objects(model, config, megatron_optimizer)
        before = _identities(objects)
        optimizer = megatron_optimizer
        if guarded:
            optimizer = GuardedMegatronOptimizer(megatron_optimizer, model, policy=POLICY)
        flat = _train(model, config, optimizer)
        runs[guarded] = (_changed(before, _identities(objects)), flat)
    ours = {key: sorted(names - runs[False][0][key]) for key, names in runs[True][0].items()}
    return {key: names for key, names in ours.items() if names}, bool(
        torch.equal(runs[True][1], runs[False][1]))


def _drifted_step_is_refused():
    """MixedPrecisionOptimizer.step replaced by a modified copy (a release that changed it): the
    error without the opt-in, the warning and the applied steps with it."""
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
    from stepguard.integrations.megatron import GuardedMegatronOptimizer
    real = MixedPrecisionOptimizer.__dict__["step"]

    def step(self):  # a release that changed Megatron's step
        return real(self)

    MixedPrecisionOptimizer.step = step
    try:
        model, config, megatron_optimizer = _build("bf16", False)
        try:
            GuardedMegatronOptimizer(megatron_optimizer, model, policy=POLICY)
            refused = "accepted"
        except RuntimeError as e:
            refused = str(e)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = GuardedMegatronOptimizer(megatron_optimizer, model, policy=POLICY,
                                                 allow_untested_framework=True)
        _train(model, config, optimizer)
        warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        return refused, warned, optimizer.guard.stats().totals.applied
    finally:
        MixedPrecisionOptimizer.step = real


def _renamed_copy_is_refused():
    """A Megatron whose bf16 optimizer lost _copy_main_params_to_model_params (a release that
    renamed it): the seam check names it, and under the opt-in the guarded optimizer still
    refuses (a rollback would leave the model's weights unrestored)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as F16
    from stepguard.integrations.megatron import GuardedMegatronOptimizer

    model, _, megatron_optimizer = _build("bf16", False)
    real = F16.__dict__["_copy_main_params_to_model_params"]
    del F16._copy_main_params_to_model_params
    out = []
    try:
        for allow in (False, True):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    GuardedMegatronOptimizer(megatron_optimizer, model, policy=POLICY,
                                             allow_untested_framework=allow)
                out.append("accepted")
            except RuntimeError as e:
                out.append(str(e))
    finally:
        F16._copy_main_params_to_model_params = real
    return out


def _refused(change):
    from stepguard.integrations.megatron import GuardedMegatronOptimizer
    model, _, megatron_optimizer = _build("bf16", False)
    change(model)
    try:
        GuardedMegatronOptimizer(megatron_optimizer, model, policy=POLICY)
    except ValueError as e:
        return str(e)
    return "accepted"


def _rank_main(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron_cpu
    megatron_cpu.install()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    results = {"writes": {str(d): _writes_nothing(d) for d in (False, True)},
               "drift": _drifted_step_is_refused(), "renamed": _renamed_copy_is_refused(),
               "grad_norm_group": _refused(lambda model: setattr(
                   model.module.output_layer.weight, "grad_norm_group", "mtp")),
               # Megatron-FSDP's DDP config carries the flag (Megatron-FSDP needs CUDA)
               "fsdp": _refused(lambda model: setattr(model.ddp_config, "use_megatron_fsdp",
                                                      True))}
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(results, f, default=str)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_megatron_seams():
    (out,) = spawn_ranks(_rank_main, 1)
    for distributed_optimizer in ("False", "True"):
        ours, same = out["writes"][distributed_optimizer]
        assert ours == {}, (distributed_optimizer, ours)  # the seams table declares no write
        assert same, distributed_optimizer  # no clip binds: the guarded run is Megatron's own
    refused, warned, applied = out["drift"]
    assert ("megatron.core.optimizer.optimizer.MixedPrecisionOptimizer.step: its code differs "
            "from the tested releases'" in refused and "relied on to follows "
            "megatron.core.optimizer.optimizer.MegatronOptimizer.step" in refused), refused
    assert any("allow_untested_framework=True: running anyway" in w for w in warned), warned
    assert applied == STEPS
    without, allowed = out["renamed"]
    assert ("Float16OptimizerWithFloat16Params._copy_main_params_to_model_params: not found"
            in without and "a rollback copies the restored main" in without), without
    assert ("Float16OptimizerWithFloat16Params has no _copy_main_params_to_model_params" in allowed
            and "rollback" in allowed), allowed
    assert "separate grad-norm groups ['mtp']" in out["grad_norm_group"], out["grad_norm_group"]
    assert "Megatron-FSDP is not guarded" in out["fsdp"], out["fsdp"]

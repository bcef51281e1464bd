"""pytest setup: the stepguard package from the build tree (PYTHONPATH=build/python, set by
ctest), small models and helpers shared by the Python tests."""

import torch
import torch.nn as nn

torch.set_num_threads(1)


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loss_of(model, batch):
    g = torch.Generator().manual_seed(1000 + batch)
    x = torch.randn(5, 8, generator=g)
    y = torch.randn(5, 4, generator=g)
    return nn.functional.mse_loss(model(x), y)


def stepped_guard(seed, steps, optimizer_class=None, lr=1e-3):
    """A model and its guard (Adam unless told) after `steps` clean steps."""
    import stepguard
    model = make_model(seed)
    optimizer = (optimizer_class or torch.optim.Adam)(model.parameters(), lr=lr)
    guard = stepguard.GuardedOptimizer(optimizer, model.named_parameters())
    for step in range(steps):
        guard.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        guard.step(loss)
    return model, guard


def clone_state(optimizer):
    out = {}
    for p, st in optimizer.state.items():
        out[id(p)] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    return out


def same_state(optimizer, saved):
    if {id(p) for p in optimizer.state if optimizer.state[p]} != set(saved):
        return False
    for p, st in optimizer.state.items():
        if not st:
            continue
        ref = saved[id(p)]
        if set(st) != set(ref):
            return False
        for k, v in st.items():
            if torch.is_tensor(v):
                if not (torch.is_tensor(ref[k]) and v.dtype == ref[k].dtype
                        and torch.equal(v, ref[k])):
                    return False
            elif v != ref[k]:
                return False
    return True

"""Several torch optimizers seen as one ``torch.optim.Optimizer``, for the guard's port: those of
a Megatron ``ChainedOptimizer`` (MoE: the dense and the expert parameters' optimizers), and those
of torchtitan's ``OptimizersContainer`` (one per model part and parameter-group recipe). Its
``param_groups`` are every optimizer's groups in chain order (the same dicts, so an LR written
into one reaches its optimizer), and its ``state`` is every optimizer's state, each entry read
from and written to the optimizer that steps the parameter. Nothing steps it: the integration's
port runs the framework's own update (Megatron's chain, torchtitan's container)."""

from collections.abc import MutableMapping

import torch


class _ChainedState(MutableMapping):
    """The optimizers' ``state`` dicts as one mapping, keyed by parameter; each write goes to the
    optimizer whose groups hold the parameter."""

    def __init__(self, optimizers):
        self._optimizers = optimizers
        self._owners = {id(p): optimizer for optimizer in optimizers
                        for g in optimizer.param_groups for p in g["params"]}

    def _owner(self, param):
        owner = self._owners.get(id(param))
        if owner is None:
            raise KeyError("stepguard: the parameter is in none of the chained optimizers")
        return owner.state

    def __getitem__(self, param):
        for optimizer in self._optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        raise KeyError(param)

    def __setitem__(self, param, value):
        self._owner(param)[param] = value

    def __delitem__(self, param):
        for optimizer in self._optimizers:
            if param in optimizer.state:
                del optimizer.state[param]
                return
        raise KeyError(param)

    def __iter__(self):
        for optimizer in self._optimizers:
            yield from optimizer.state

    def __len__(self):
        return sum(len(optimizer.state) for optimizer in self._optimizers)


class ChainedTorchOptimizer(torch.optim.Optimizer):
    """Several torch optimizers as one (see the module's docstring). ``Optimizer.__init__`` is
    not called: the chained optimizers hold the groups and the state."""

    def __init__(self, optimizers):  # pylint: disable=super-init-not-called
        self.optimizers = list(optimizers)
        self.defaults = dict(self.optimizers[0].defaults)

    @property
    def param_groups(self):
        return [g for optimizer in self.optimizers for g in optimizer.param_groups]

    @property
    def state(self):
        return _ChainedState(self.optimizers)

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        raise RuntimeError("stepguard: the chained optimizers are stepped by the framework's "
                           "own container (Megatron's ChainedOptimizer, torchtitan's "
                           "OptimizersContainer), not through this view")

    def state_dict(self):
        return [optimizer.state_dict() for optimizer in self.optimizers]

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, (list, tuple)) or len(state_dict) != len(self.optimizers):
            raise ValueError("stepguard: expected a list of %d optimizer state dicts"
                             % len(self.optimizers))
        for optimizer, state in zip(self.optimizers, state_dict):
            optimizer.load_state_dict(state)

    def __repr__(self):
        return "ChainedTorchOptimizer(%s)" % ", ".join(type(o).__name__ for o in self.optimizers)

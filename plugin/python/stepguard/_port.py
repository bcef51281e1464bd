"""The torch.optim port: what the step engine needs of a PyTorch optimizer.

The engine (C++) calls these methods with the GIL held: the parameters and their names, the
optimizer step with an LR factor, and the optimizer state as named tensors (copied by snapshots and
written back in place by a restore) plus opaque bytes for everything that is not a tensor.
The framework integrations (stepguard.integrations) derive from TorchOptimPort.

A ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1: each rank holds the optimizer state
of its own shard of the parameters, every rank holds all parameters) is recognised by type: its
parameters are all of them, its state is the local optimizer's (``optimizer.optim``), the shard.
"""

import operator

import torch

from . import _safe_pickle

try:
    from torch.distributed.optim import ZeroRedundancyOptimizer as _ZeroRedundancyOptimizer
except ImportError:  # a torch built without distributed support has no ZeRO to recognise
    _ZeroRedundancyOptimizer = None
try:
    from torch.distributed.tensor import DTensor as _DTensor
    from torch.distributed.tensor import Shard as _Shard
except ImportError:
    _DTensor = _Shard = None

# Param-group settings that change which tensors an optimizer's state holds.
_STATE_SWITCHES = ("amsgrad", "centered")

# Opaque state bytes: a marker, then a pickle of plain values only (_safe_pickle reads it without
# running code): P2 {"optimizer": its type, "state": the structure, "switches": the state
# switches per group, "groups": each group's hyper-parameters}; P1 the structure alone.
_FORMAT = b"P2"
_FORMAT_P1 = b"P1"


def is_dtensor(t):
    """True for a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and gradients)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def local_tensor(t):
    """This rank's shard of a DTensor (the same storage: in-place writes reach the DTensor), or
    ``t`` itself."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def check_sharded(name, t, what):
    """A DTensor the guard can sum over ranks: sharded (``Shard``) on every mesh dimension, so
    each element lives on exactly one rank."""
    for placement in t.placements:
        if not isinstance(placement, _Shard):
            raise ValueError(
                "stepguard: the %s of '%s' is a DTensor placed %s on mesh %s; the guard sums "
                "sharded gradients over ranks and needs Shard on every mesh dimension (FSDP2's "
                "fully_shard on a 1-D mesh). Replicated or partial placements would be counted "
                "more than once" % (what, name, tuple(t.placements), tuple(t.device_mesh.shape)))


def check_name(name, what):
    """A name that reports, traces and metrics can carry: a str that is valid UTF-8."""
    if not isinstance(name, str):
        raise TypeError("stepguard: a %s must be a str, got %s %r" % (what, type(name).__name__,
                                                                     name))
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("stepguard: the %s %r is not valid UTF-8 (it holds a lone surrogate, "
                         "e.g. from undecodable bytes); rename it" % (what, name)) from None
    return name


def is_zero_redundancy(optimizer):
    """True for a ``torch.distributed.optim.ZeroRedundancyOptimizer``."""
    return _ZeroRedundancyOptimizer is not None and isinstance(optimizer, _ZeroRedundancyOptimizer)


class TorchOptimPort:
    """Drives any ``torch.optim.Optimizer``.

    Parameters are taken from ``optimizer.param_groups`` in order; names come from
    ``named_parameters`` (matched by identity), else ``param_<i>``. The state of parameter ``i``
    is ``optimizer.state[p]``: its tensors are named ``"<i>.<key>"``; its other values (and which
    device each tensor lives on) travel in the opaque bytes. Not thread-safe.

    A ``ZeroRedundancyOptimizer`` is driven as it is (its ``step()`` updates this rank's shard and
    broadcasts every shard), with three differences: the state is the local optimizer's
    (``optimizer.optim.state``, this rank's shard; ``i`` stays the index among all parameters, so
    a snapshot or checkpoint holds this rank's shard and never calls the collective
    ``consolidate_state_dict``); the LR factor goes into the local optimizer's param groups too
    and is taken out of both after the step; a restore checks that the saved state belongs to
    this rank's shard. ``overlap_with_ddp=True`` is refused: its steps run inside DDP's
    communication hook, where the guard cannot skip them.
    """

    def __init__(self, optimizer, named_parameters=None, layout=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "stepguard: expected a torch.optim.Optimizer, got " + type(optimizer).__name__)
        self.zero = is_zero_redundancy(optimizer)
        if self.zero and optimizer._overlap_with_ddp:
            raise ValueError(
                "stepguard: ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside DDP's "
                "communication hook, so its steps cannot be skipped or rolled back; build it with "
                "overlap_with_ddp=False (the default) to guard it")
        self.optimizer = optimizer
        self._names_by_id = {}
        if named_parameters is not None:
            for item in named_parameters:
                if torch.is_tensor(item) or not isinstance(item, (tuple, list)) or len(item) != 2:
                    # model.parameters() where model.named_parameters() goes.
                    raise TypeError(
                        "stepguard: named_parameters must give (name, parameter) pairs, as "
                        "model.named_parameters() does; got %s (model.parameters()? pass "
                        "model.named_parameters(), or nothing for param_<i> names)"
                        % ("a tensor" if torch.is_tensor(item) else type(item).__name__))
                name, p = item
                self._names_by_id[id(p)] = check_name(name, "parameter name")
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if params and not any(id(p) in self._names_by_id for p in params):
                raise ValueError(
                    "stepguard: none of the optimizer's %d parameters is in named_parameters (of "
                    "another model, or a copy?); pass the named_parameters() of the model whose "
                    "parameters the optimizer holds" % len(params))
        self._params = []  # the optimizer's own (DTensors under FSDP2)
        self._local = []   # what the engine reads and writes: this rank's shards
        self._names = []
        self._layout = _checked_layout(layout)
        self.dtensors = any(is_dtensor(p) for g in optimizer.param_groups for p in g["params"])
        if not self.dtensors and type(self).gradients is TorchOptimPort.gradients:
            self.gradients = None  # the engine reads each parameter's .grad itself, in C++

    # -- parameters ---------------------------------------------------------------------------
    def parameters(self):
        """The parameters (this rank's local tensors) and their names, tracked by identity: a
        group added, or tensors swapped into a group (accelerate's ``_switch_parameters`` does),
        gives a new list; a swapped-in tensor keeps the name of the one it replaced."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(params) != len(self._params) or not all(map(operator.is_, params, self._params)):
            old = self._names if len(params) == len(self._names) else []
            names = []
            for i, p in enumerate(params):
                fallback = old[i] if old else "param_%d" % i
                names.append(self._names_by_id.get(id(p), fallback))
            for p, name in zip(params, names):
                if is_dtensor(p):
                    check_sharded(name, p, "parameter")
            self._params, self._names = params, names
            self._local = [local_tensor(p) for p in params]
        return self._local, self._names

    def gradients(self):
        """The gradients to inspect: this rank's shards of DTensor gradients (FSDP2). A port
        without DTensors sets ``gradients = None``: the engine then reads ``.grad`` itself."""
        out = []
        for p, name in zip(self._params, self._names):
            g = p.grad
            if g is not None and is_dtensor(g):
                check_sharded(name, g, "gradient")
                g = local_tensor(g)
            out.append(g)
        return out

    def sharded_state(self):
        """True when each rank holds only its own shard of the optimizer state (ZeRO)."""
        return self.zero

    def gradients_reduced_into_shards(self):
        """True for DTensor parameters (FSDP2): their gradients are set after the reduce-scatter,
        so a rank's shard holds what every rank sent it."""
        return self.dtensors

    def layout(self):
        """How the ranks hold each parameter's gradient (``stepguard.Placement``, one per
        parameter), or None: every one a replica (or a shard, with sharded_gradients)."""
        return self._layout

    def _state_owner(self):
        """The optimizer whose ``state`` holds this rank's optimizer state."""
        return self.optimizer.optim if self.zero else self.optimizer

    # -- the step -----------------------------------------------------------------------------
    #: What the wrapped optimizer's step raised in the last apply() (the engine sees only its
    #: text); GuardedOptimizer.step raises it again with its own type.
    failure = None
    #: True while apply() runs the wrapped optimizer's update (a step of it at any other time
    #: did not come through the guard).
    updating = False

    def largest_lr(self):
        """The largest ``lr`` of the groups (the stall detector's), None when one is a tensor on
        a device (reading it would wait for the device) or not a number."""
        out = None
        for group in self.optimizer.param_groups:
            lr = group.get("lr")
            if torch.is_tensor(lr):
                if lr.device.type != "cpu" or lr.numel() != 1:
                    return None
                lr = float(lr)
            if not isinstance(lr, (int, float)):
                return None
            out = lr if out is None else max(out, lr)
        return None if out is None else float(out)

    def apply(self, lr_factor):
        """One optimizer step with every group's lr multiplied by ``lr_factor`` for its duration."""
        self.updating = True
        try:
            self._apply(lr_factor)
        except BaseException as e:
            self.failure = e
            raise
        finally:
            self.updating = False

    def _apply(self, lr_factor):
        if lr_factor == 1.0:
            self.update()
            return
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        # ZeRO copies its groups' settings into the local optimizer's at the step and back after
        # it: both carry the factor during the step and lose it after.
        local = self.optimizer.optim.param_groups if self.zero else []
        try:
            for g, lr in zip(groups, saved):
                g["lr"] = lr * lr_factor
            for g, lr in zip(local, saved):
                g["lr"] = lr * lr_factor
            self.update()
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr
            for g, lr in zip(local, saved):
                g["lr"] = lr

    def update(self):
        """The update itself (integrations replace it)."""
        self.optimizer.step()

    # -- state --------------------------------------------------------------------------------
    def _states(self):
        self.parameters()
        params = self._params
        state = self._state_owner().state
        for i, p in enumerate(params):
            if p in state and state[p]:
                yield i, p, state[p]

    def state_tensors(self):
        out = []
        for i, _, st in self._states():
            for key in sorted(st):
                if torch.is_tensor(st[key]):
                    out.append(("%d.%s" % (i, key), local_tensor(st[key])))
        return out

    def state_owner(self, index):
        """What the state tensors "<index>.<key>" belong to (for a report): the optimizer's own
        parameter of that index (a framework's flat partition where the state is keyed so)."""
        self.parameters()
        return self._names[index] if 0 <= index < len(self._names) else None

    def state_bytes(self):
        structure = []
        for i, p, st in self._states():
            entry = {}
            for key in sorted(st):
                value = st[key]
                if is_dtensor(value):
                    entry[key] = ("dtensor", True)  # placed as its parameter
                elif torch.is_tensor(value):
                    entry[key] = ("tensor", value.device == p.device)
                else:
                    entry[key] = ("value", value)
            structure.append((i, entry))
        groups = self._group_settings()
        if not structure and not groups:
            return b""
        return _FORMAT + _safe_pickle.dumps({"optimizer": self._optimizer_type(),
                                             "state": structure, "switches": self._switches(),
                                             "groups": groups})

    def _group_settings(self):
        """Each param group's hyper-parameters (lr, betas, weight_decay, ...: every entry but
        ``params`` that is a plain value), as ``state_dict()`` keeps them; a resume from a disk
        checkpoint puts them back, a rollback leaves the live ones (the loop's schedulers own
        the LR between snapshots)."""
        return [{k: v for k, v in g.items() if k != "params" and _plain(v)}
                for g in self.optimizer.param_groups]

    def _switches(self):
        """Each param group's settings that decide which tensors the state holds (Adam's amsgrad
        adds max_exp_avg_sq, RMSprop's centered adds grad_avg): a state saved under others does
        not fit, and the optimizer's next step would fail on it."""
        return [sorted((k, v) for k, v in g.items() if k in _STATE_SWITCHES)
                for g in self._state_owner().param_groups]

    def _optimizer_type(self):
        owner = self._state_owner()
        return "%s.%s" % (type(owner).__module__, type(owner).__qualname__)

    def _read(self, data, saved):
        """The structure in ``data`` and the param groups' settings it recorded (none before the
        fifth trust round), checked against this optimizer and the saved tensors."""
        groups = []
        if not data:
            if saved:
                raise ValueError("the saved optimizer state has tensors but no structure")
            return [], groups
        if data.startswith(_FORMAT_P1):
            structure = _safe_pickle.loads(data[len(_FORMAT_P1):])  # no optimizer type recorded
        elif data.startswith(_FORMAT):
            record = _safe_pickle.loads(data[len(_FORMAT):])
            # "switches" since the fourth trust round; records without them are read as before.
            # "groups" since the fifth. Records without them are read as before.
            if not isinstance(record, dict) or not (
                    {"optimizer", "state"} <= set(record) <= {"optimizer", "state", "switches",
                                                              "groups"}):
                raise ValueError("the saved optimizer state's structure is malformed")
            if record["optimizer"] != self._optimizer_type():
                raise ValueError("the saved optimizer state was written by %s; this optimizer is "
                                 "%s" % (record["optimizer"], self._optimizer_type()))
            if "switches" in record:
                self._check_switches(record["switches"])
            if "groups" in record:
                self._check_groups(record["groups"])
                groups = record["groups"]
            structure = record["state"]
        else:
            raise ValueError("the saved optimizer state is not a torch.optim port's")
        _check_structure(structure)
        self.parameters()
        params, names = self._params, self._names
        tensors = dict(saved)
        named = set()
        for i, entry in structure:
            if not 0 <= i < len(params):
                raise ValueError("the saved optimizer state names parameter %d; the optimizer "
                                 "has %d" % (i, len(params)))
            if self.zero:
                self._check_own_shard(i, params[i], names[i])
            for key, (kind, _) in entry.items():
                if kind == "value":
                    continue
                if kind == "dtensor" and not is_dtensor(params[i]):
                    raise ValueError("the saved optimizer state of parameter %d ('%s') is "
                                     "sharded (DTensor) but the parameter is not" % (i, names[i]))
                name = "%d.%s" % (i, key)
                if name not in tensors:
                    raise ValueError("the saved optimizer state lacks tensor '%s'" % name)
                named.add(name)
        unnamed = sorted(set(tensors) - named)
        if unnamed:
            raise ValueError("the saved optimizer state holds tensor '%s', which its structure "
                             "does not name" % unnamed[0])
        return structure, groups

    def _check_switches(self, saved):
        mine = self._switches()
        if not isinstance(saved, list) or len(saved) != len(mine):
            raise ValueError("the saved optimizer state has %s param groups; this optimizer has "
                             "%d" % (len(saved) if isinstance(saved, list) else "no", len(mine)))
        for g, (theirs, ours) in enumerate(zip(saved, mine)):
            theirs = dict(theirs) if isinstance(theirs, list) else {}
            for key, value in ours:
                if key in theirs and theirs[key] != value:
                    raise ValueError("the saved optimizer state was written with %s=%s in param "
                                     "group %d; this optimizer has %s=%s (the state's tensors "
                                     "differ)" % (key, theirs[key], g, key, value))

    def _check_groups(self, saved):
        mine = self.optimizer.param_groups
        if not isinstance(saved, list) or len(saved) != len(mine):
            raise ValueError("the saved optimizer state has %s param groups; this optimizer has "
                             "%d" % (len(saved) if isinstance(saved, list) else "no", len(mine)))
        for g, settings in enumerate(saved):
            if not isinstance(settings, dict) or not all(isinstance(k, str) and k != "params"
                                                         for k in settings):
                raise ValueError("the saved settings of param group %d are malformed" % g)
            lr = settings.get("lr", 0.0)
            if type(lr) not in (int, float) or not 0.0 <= lr < float("inf"):
                raise ValueError("the saved lr of param group %d is %r, not a finite number >= 0"
                                 % (g, lr))

    def _check_own_shard(self, i, param, name):
        owner = self.optimizer._param_to_rank.get(param)
        if owner != self.optimizer.rank:
            raise ValueError(
                "the saved optimizer state holds parameter %d ('%s'), which this "
                "ZeroRedundancyOptimizer assigns to rank %s, not to this rank %d: the optimizer "
                "state is sharded, and this shard was saved by another rank or partition"
                % (i, name, owner, self.optimizer.rank))

    def check_state_bytes(self, data, saved):
        self._read(data, saved)

    def load_state_bytes(self, data, saved, settings=False):
        """Rebuilds the state's structure; the engine then fills its tensors in place. With
        ``settings`` (a resume from a disk checkpoint, not a rollback) the param groups'
        hyper-parameters are put back too, as ``load_state_dict`` does."""
        structure, groups = self._read(data, saved)
        self.parameters()
        params = self._params
        tensors = dict(saved)
        state = self._state_owner().state
        rebuilt = {}
        for i, entry in structure:
            p = params[i]
            live = state.get(p, {})
            st = {}
            for key, (kind, detail) in entry.items():
                if kind == "value":
                    st[key] = detail
                    continue
                like = tensors["%d.%s" % (i, key)]
                device = p.device if detail else torch.device("cpu")
                old = live.get(key)
                if kind == "dtensor":
                    st[key] = _sharded_like(old, like, p)
                elif (torch.is_tensor(old) and not is_dtensor(old) and old.shape == like.shape
                        and old.dtype == like.dtype and old.device == device):
                    st[key] = old
                else:
                    st[key] = torch.empty(like.shape, dtype=like.dtype, device=device)
            rebuilt[p] = st
        # The parameters' entries are replaced; anything else a subclass keeps in state stays.
        for p in params:
            state.pop(p, None)
        state.update(rebuilt)
        if settings:
            for group, values in zip(self.optimizer.param_groups, groups):
                group.update(values)

    def after_restore(self):
        pass


def _plain(value):
    """True for a value the state bytes may carry: None, a bool, number or str, or a tuple or
    list of them (a tensor-valued lr, for one, is not kept)."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    return type(value) in (tuple, list) and all(_plain(v) for v in value)


def _checked_layout(layout):
    """A list of ``stepguard.Placement`` (or None), checked item by item."""
    if layout is None:
        return None
    from . import _C
    out = list(layout)
    for i, p in enumerate(out):
        if not isinstance(p, _C.Placement):
            raise TypeError("stepguard: layout[%d] is %s, not a stepguard.Placement (replica(), "
                            "replicated(n), shard(n), absent())" % (i, type(p).__name__))
    return out


def _sharded_like(old, like, param):
    """A DTensor placed as ``param`` whose local shard is shaped as the saved ``like``: ``old``
    when it already is one, else a new one (filled in place by the restore)."""
    if is_dtensor(old):
        local = local_tensor(old)
        if local.shape == like.shape and local.dtype == like.dtype:
            return old
    local = torch.empty(like.shape, dtype=like.dtype, device=local_tensor(param).device)
    return _DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                               shape=param.shape, stride=param.stride())


def _check_structure(structure):
    """[(parameter index, {key: (kind, detail)})], as state_bytes() writes it."""
    ok = isinstance(structure, list)
    for item in structure if ok else ():
        ok = (isinstance(item, tuple) and len(item) == 2 and type(item[0]) is int
              and isinstance(item[1], dict))
        if not ok:
            break
        for key, value in item[1].items():
            if not (isinstance(key, str) and isinstance(value, tuple) and len(value) == 2
                    and value[0] in ("tensor", "dtensor", "value")):
                ok = False
                break
    if not ok:
        raise ValueError("the saved optimizer state's structure is malformed")

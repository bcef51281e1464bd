"""The optimizer state's opaque bytes, read without running code.

A checkpoint's bytes are checked for damage (XXH3), not for their author; a plain pickle would run
whatever callable it names while it is loaded. These bytes are read with an unpickler that admits
only the plain values an optimizer state holds besides its tensors (numbers, strings, booleans,
None, containers, complex numbers, sets, torch devices), as ``torch.load(weights_only=True)`` limits
a checkpoint; anything else is refused with the name it asked for. What the guard writes is checked
the same way, so a state it could not read back is refused when it is saved, not when it is needed.
"""

import collections
import io
import pickle

import torch

_ALLOWED = {
    ("builtins", "complex"): complex,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "device"): torch.device,
}


class UnsafeStateError(ValueError):
    """The bytes name a type or callable an optimizer state never holds."""


class _Restricted(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeStateError(
                "the saved optimizer state names '%s.%s', which an optimizer state never holds; "
                "refusing to load it (only numbers, strings, booleans, None, lists, tuples, dicts, "
                "sets, complex numbers and torch devices are admitted besides tensors)"
                % (module, name)) from None

    def persistent_load(self, pid):
        raise UnsafeStateError("the saved optimizer state holds a persistent reference, which an "
                               "optimizer state never does")


def loads(data):
    """The value pickled in ``data``, admitting only plain values (UnsafeStateError otherwise,
    ValueError when the bytes are not a whole pickle)."""
    try:
        return _Restricted(io.BytesIO(data)).load()
    except UnsafeStateError:
        raise
    except Exception as e:  # a truncated or garbled pickle
        raise ValueError("the saved optimizer state's bytes do not read back (%s: %s)"
                         % (type(e).__name__, e)) from None


def dumps(value):
    """``value`` pickled, checked to read back through ``loads``: a state holding anything else
    is refused now, naming it."""
    data = pickle.dumps(value, protocol=4)
    try:
        loads(data)
    except UnsafeStateError as e:
        raise UnsafeStateError("stepguard cannot save this optimizer state safely: %s" % e) from None
    return data

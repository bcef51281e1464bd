"""The Python package's files, through the engine's one file layer (csrc/common/safe_file.h, bound
in stepguard._C): every file the package's Python code reads or writes goes through here and
nowhere else (the engine's own files go through safe_file.h in C++).

Writing: a fresh temporary file beside the target, then a rename over it; never through a link
planted at either name, never into a file stepguard did not create. Reading: a regular file only
(a FIFO, a device, a socket or a directory is refused unopened), of at most the size its kind of
file can have. Errors are ``FileError`` (an ``OSError``) whose message starts with the path; a
file that does not exist is also a ``FileNotFoundError``, as ``open()`` raises.

Thin wrappers: the checks themselves live in the engine, shared with the C++ side.
"""

import errno
import io
import os

import torch

from . import _C

FileError = _C.FileError

# A guard's state is a few counters, detector words and skipped ranges: kilobytes.
MAX_GUARD_STATE_BYTES = 64 << 20
# A trace is one line per step of a run that may be long; the cap of the C++ replay (replay.cpp).
MAX_TRACE_BYTES = 64 << 30
# Reports are a few kilobytes; evidence and tensor lists are bounded by the writer (as tools.cpp).
MAX_REPORT_BYTES = 16 << 20

_READ_BLOCK = 1 << 20  # read_regular's unit: a cap is reserved block by block, not at once
# How the binding says that the file does not exist: "PATH: cannot read: <strerror(ENOENT)>".
_MISSING = ": cannot read: " + os.strerror(errno.ENOENT)


class FileMissing(FileError, FileNotFoundError):
    """The file does not exist: a ``FileError`` naming it, and the ``FileNotFoundError`` callers
    of ``open()`` expect (errno ENOENT)."""

    def __str__(self):
        return "%s: cannot read: %s" % (self.filename, self.strerror)


def write_bytes(path, data):
    """Writes ``data`` to ``path`` atomically (see the module's docstring)."""
    _C.write_file_atomically(os.fspath(path), bytes(data))


def save_torch(obj, path):
    """``torch.save(obj, path)``, written as write_bytes writes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes(path, buffer.getvalue())


def save_figure(fig, path, **savefig_kwargs):
    """``fig.savefig(path, ...)``, written as write_bytes writes. The format is the keyword's, or
    the extension's, or PNG (matplotlib cannot tell it from a buffer)."""
    extension = os.path.splitext(os.fspath(path))[1][1:].lower()
    savefig_kwargs.setdefault("format", extension or "png")
    buffer = io.BytesIO()
    fig.savefig(buffer, **savefig_kwargs)
    write_bytes(path, buffer.getvalue())


def open_regular(path, max_bytes):
    """``path`` open for binary reading when it is a regular file of at most ``max_bytes``."""
    path = os.fspath(path)
    try:
        fd = _C.open_regular_file(path, max_bytes)
    except FileError as e:
        if str(e) == path + _MISSING:
            raise FileMissing(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
        raise
    return os.fdopen(fd, "rb")


def read_regular(path, max_bytes):
    """The bytes of ``path`` when it is a regular file of at most ``max_bytes``, then and while
    it is read (one that grows past the cap meanwhile is refused)."""
    # In blocks, up to one byte past the cap: f.read(n) would reserve all n bytes at once.
    blocks, left = [], max_bytes + 1
    with open_regular(path, max_bytes) as f:
        while left > 0:
            block = f.read(min(left, _READ_BLOCK))
            if not block:
                break
            blocks.append(block)
            left -= len(block)
    data = b"".join(blocks)
    if len(data) > max_bytes:
        raise FileError("%s: cannot read: it grew past the %d bytes this file can hold"
                        % (os.fspath(path), max_bytes))
    return data


def load_torch(path, max_bytes):
    """``torch.load(path, weights_only=True)`` of a regular file of at most ``max_bytes``."""
    return torch.load(io.BytesIO(read_regular(path, max_bytes)), weights_only=True)

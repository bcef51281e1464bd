"""Every file the Python package reads or writes goes through stepguard._files, the engine's one
file layer: a link planted at a name it writes (the target or its temporary file) is replaced,
never written through; a FIFO, a device, a folder or a file over its cap is refused unread, the
path in the message, within seconds. Cases: the layer itself, the HF callback's guard state file,
`stepguard plot`'s trace and the incident pictures."""

import contextlib
import os
import resource
import signal
import types

import pytest
import torch

import stepguard
from stepguard import _files, plot
from conftest import stepped_guard

PRECIOUS = b"precious: not stepguard's to write"
SECONDS = 10  # each case takes milliseconds; a reader waiting on a FIFO is stopped here
HEADROOM = 1 << 30  # what a case may add to the address space before a device read is stopped


def _address_space():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@contextlib.contextmanager
def bounded():
    """A regression fails here instead of hanging the run: SIGALRM interrupts an open() that
    waits for a FIFO's writer, and the address space cap ends a read of /dev/zero."""
    def too_long(signum, frame):
        raise TimeoutError("still reading after %d s (waiting on a FIFO?)" % SECONDS)

    previous = signal.signal(signal.SIGALRM, too_long)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY
                                            else min(cap, hard), hard))
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _outside(tmp_path, name):
    """A file outside the folders stepguard writes, with known content."""
    path = tmp_path / name
    path.write_bytes(PRECIOUS)
    return path


def _plant(tmp_path, name, kind):
    """Something that is not a regular file, at tmp_path/name."""
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        path.mkdir()
    else:
        raise AssertionError(kind)
    return str(path)


NOT_REGULAR = {"fifo": "a FIFO, not a regular file", "link to /dev/zero": "not a regular file",
               "directory": "a directory"}


# -- the layer -------------------------------------------------------------------------------
def test_write_bytes_replaces_links_planted_at_the_target_and_its_temporary_name(tmp_path):
    target, temp = tmp_path / "out.bin", tmp_path / ("out.bin.tmp.%d" % os.getpid())
    os.symlink(_outside(tmp_path, "a"), target)
    os.symlink(_outside(tmp_path, "b"), temp)
    _files.write_bytes(target, b"written")
    assert (tmp_path / "a").read_bytes() == PRECIOUS and (tmp_path / "b").read_bytes() == PRECIOUS
    assert not target.is_symlink() and target.read_bytes() == b"written"
    assert not os.path.lexists(temp)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "link to /dev/zero", "directory"])
def test_open_regular_refuses_what_is_not_a_regular_file(tmp_path, kind):
    path = "/dev/zero" if kind == "/dev/zero" else _plant(tmp_path, "x", kind)
    for read in (_files.open_regular, _files.read_regular):
        with bounded(), pytest.raises(_files.FileError) as e:
            read(path, 1 << 20)
        assert str(e.value).startswith(path + ": cannot read: "), str(e.value)
        assert NOT_REGULAR.get(kind, "not a regular file") in str(e.value)


def test_open_regular_takes_a_regular_file_up_to_its_cap_and_no_more(tmp_path):
    path = tmp_path / "eleven"
    path.write_bytes(b"0123456789\n")
    with _files.open_regular(path, 11) as f:
        assert f.read() == b"0123456789\n"
    os.symlink(path, tmp_path / "link")  # a link to a regular file is followed
    assert _files.read_regular(tmp_path / "link", 11) == b"0123456789\n"
    with pytest.raises(_files.FileError) as e:
        _files.read_regular(path, 10)
    assert str(e.value) == ("%s: cannot read: 11 bytes, more than the 10 this file can hold"
                            % path)
    with pytest.raises(FileNotFoundError) as e:
        _files.open_regular(tmp_path / "none", 10)
    assert isinstance(e.value, _files.FileError)
    assert str(e.value) == "%s: cannot read: No such file or directory" % (tmp_path / "none")


# -- the HF callback's guard state ------------------------------------------------------------
def _guard(steps):
    return stepped_guard(1, steps, torch.optim.SGD, lr=0.1)[1]


def _callback(guard, resume_from=None):
    from stepguard.integrations.transformers import StepguardCallback

    callback = StepguardCallback()
    callback.guard, callback._resume_from = guard, resume_from
    return callback


def test_the_hf_guard_state_is_saved_beside_planted_links_and_read_back(tmp_path):
    callback = _callback(_guard(steps=2))
    checkpoint = tmp_path / "checkpoint-7"
    checkpoint.mkdir()
    state = checkpoint / "stepguard_rank0.pt"
    os.symlink(_outside(tmp_path, "a"), state)
    os.symlink(_outside(tmp_path, "b"), "%s.tmp.%d" % (state, os.getpid()))
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    callback.on_save(args, types.SimpleNamespace(global_step=7), None)
    assert (tmp_path / "a").read_bytes() == PRECIOUS and (tmp_path / "b").read_bytes() == PRECIOUS
    assert state.is_file() and not state.is_symlink()
    assert torch.load(state, weights_only=True)["step"] == 2
    # Resumed from it, a fresh guard goes on from step 2; from a checkpoint without the file, it
    # starts afresh with a warning.
    resumed = _callback(_guard(steps=0), resume_from=str(checkpoint))
    resumed._load_guard_state(args)
    assert resumed.guard.stats().step_count == 2
    (tmp_path / "checkpoint-8").mkdir()
    fresh = _callback(_guard(steps=0), resume_from=str(tmp_path / "checkpoint-8"))
    with pytest.warns(RuntimeWarning, match="checkpoint-8 holds no guard state"):
        fresh._load_guard_state(args)


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "directory"])
def test_a_guard_state_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, kind):
    # Not resumed from as if the checkpoint had been saved without the guard: it is damaged.
    path = _plant(tmp_path, "stepguard_rank0.pt", kind)
    callback = _callback(_guard(steps=1), resume_from=str(tmp_path))
    with bounded(), pytest.raises(_files.FileError) as e:
        callback._load_guard_state(types.SimpleNamespace(output_dir=str(tmp_path)))
    assert str(e.value).startswith(path + ": cannot read: "), str(e.value)
    assert NOT_REGULAR[kind] in str(e.value)
    assert callback.guard.stats().step_count == 1


# -- stepguard plot ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "link to /dev/zero"])
def test_plot_refuses_a_trace_that_is_not_a_regular_file(tmp_path, kind, capsys):
    path = "/dev/zero" if kind == "/dev/zero" else _plant(tmp_path, "trace.jsonl", kind)
    message = "%s: cannot read: " % path
    for from_step in (None, 5):  # the whole trace, and its end read backwards
        with bounded(), pytest.raises(plot.TraceError) as e:
            plot.read_trace(path, from_step=from_step)
        assert str(e.value).startswith(message) and "not a regular file" in str(e.value)
    # The command: exit 2, one line naming the file.
    with bounded():
        assert plot.main([path, "-o", str(tmp_path / "out.png")]) == 2
    assert capsys.readouterr().err.startswith("stepguard plot: " + message)
    assert not os.path.lexists(tmp_path / "out.png")

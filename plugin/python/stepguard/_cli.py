"""The ``stepguard`` command of the pip package: runs the C++ CLI (``policy list/show/check/
explain``, ``replay``, ``ckpt``, ``incident show``, ``demo``) the wheel carries as
``stepguard/bin/stepguard``, or, in a build tree's ``build/python``, the build's
``build/bin/stepguard``. The program links LibTorch: the installed torch's libraries and the
package's own engine library are put on its library path. (Running it imports the stepguard
package, and with it torch, first.) Also ``python -m stepguard ...``."""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def program():
    """The CLI executable's path, or None where neither the wheel nor a build tree has one."""
    for path in (os.path.join(_HERE, "bin", "stepguard"),
                 os.path.join(os.path.dirname(os.path.dirname(_HERE)), "bin", "stepguard")):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _torch_lib():
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "lib")


def main(argv=None):
    """Replaces this process with the CLI (its exit status is the command's)."""
    path = program()
    if path is None:
        sys.stderr.write("stepguard: this installation has no stepguard program (a source "
                         "checkout: build it with `make build`)\n")
        return 1
    torch_lib = _torch_lib()
    if torch_lib is None:
        sys.stderr.write("stepguard: torch is not installed in this Python (%s); the stepguard "
                         "program links LibTorch\n" % sys.executable)
        return 1
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [_HERE, torch_lib] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    args = list(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(path, ["stepguard"] + args, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())

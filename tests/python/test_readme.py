"""The README is tested (as mktestdocs and doctest keep docs true): its first example runs as
written, around a tiny model and loader; every command, flag, guard attribute, stats field and
GuardOptions setter that README.md, configs/policies/README.md and the docs/ pages name exists;
every Python block compiles and its stepguard imports import; every link between them resolves."""

import glob
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
import torch

import stepguard
from conftest import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "configs", "policies", "README.md")] + \
    sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
BUILD = os.path.dirname(os.path.dirname(os.path.abspath(stepguard.__file__)))  # build/python
CLI = os.path.join(os.path.dirname(BUILD), "bin", "stepguard")
FILE_ENDINGS = {"h", "cpp", "py", "json", "md", "yaml", "jsonl", "png", "pt"}  # report.h: a file
# Words after `stepguard CMD` that name a subcommand with its own usage.
SUBCOMMANDS = {"policy": {"check", "explain", "show", "list"}, "ckpt": {"ls", "verify"},
               "incident": {"show"}}


def _text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _blocks(text, languages=None):
    """The fenced code blocks of `text` as (language, body)."""
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if languages is None or m.group(1) in languages:
            out.append((m.group(1), m.group(2)))
    return out


def _inline(text):
    return re.findall(r"`([^`\n]+)`", text)


def _cli_commands():
    """Every `stepguard ...` command line in the docs' non-code blocks, continuations joined,
    a shell prompt and a trailing comment dropped, as (doc, tokens)."""
    out = []
    for doc in DOCS:
        for lang, body in _blocks(_text(doc)):
            if lang in ("python", "cpp", "yaml", "json", "cmake"):
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"^\$ ", "", line.strip())
                line = re.sub(r"\s#\s.*$", "", line)
                words = line.split()
                while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
                    words.pop(0)
                if not words or not words[0].endswith("stepguard") or len(words) < 2:
                    continue
                try:
                    out.append((os.path.basename(doc), shlex.split(" ".join(words))))
                except ValueError:
                    out.append((os.path.basename(doc), words))
    return out


def test_the_docs_name_commands_at_all():
    assert len(_cli_commands()) >= 15  # the parse finds the README's commands


@pytest.mark.skipif(not os.path.exists(CLI), reason="no stepguard binary beside this package")
def test_every_command_and_flag_the_docs_name_exists():
    helps = {}
    for doc, words in _cli_commands():
        command = [w for w in words[1:2]]
        if words[1].startswith("-"):  # stepguard --version
            r = subprocess.run([CLI, words[1]], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (doc, words, r.stderr)
            continue
        if len(words) > 2 and words[2] in SUBCOMMANDS.get(words[1], ()):
            command.append(words[2])
        key = tuple(command)
        if key not in helps:
            r = subprocess.run([CLI, *command, "--help"], capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0 and r.stderr == "", (doc, command, r.stderr)
            helps[key] = r.stdout
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            assert flag in helps[key], "%s: 'stepguard %s' has no %s" % (
                doc, " ".join(command), flag)


def _cpp_words(header):
    return set(re.findall(r"\b([a-z_][a-z0-9_]*)\s*\(", _text(os.path.join(
        ROOT, "plugin", "include", "stepguard", header))))


def test_every_guard_attribute_stats_field_and_setter_the_docs_name_exists():
    model = make_model(0)
    guard = stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
    stats = guard.stats()
    stats_fields = set(stats.to_dict()) | {n for n in dir(stats) if not n.startswith("_")}
    guard_names = set(dir(guard)) | _cpp_words("guarded_optimizer.h")
    report_names = set(dir(stepguard.StepReport)) | _cpp_words("types.h")
    setters = set(re.findall(r"TORCH_ARG\([^,]+,\s*(\w+)\)", _text(os.path.join(
        ROOT, "plugin", "include", "stepguard", "options.h"))))
    missing = []
    for doc in DOCS:
        text = _text(doc)
        code = [body for _, body in _blocks(text, ("python", "cpp"))] + _inline(text)
        for piece in code:
            for name in re.findall(r"\bstats\(\)\.(\w+)", piece):
                if name not in stats_fields:
                    missing.append("%s: stats().%s" % (os.path.basename(doc), name))
            for name in re.findall(r"\bguard\.(\w+)", piece):
                if name not in guard_names and name not in FILE_ENDINGS:
                    missing.append("%s: guard.%s" % (os.path.basename(doc), name))
            for name in re.findall(r"\b(?:r|report)\.(\w+)", piece):
                if name not in report_names and name not in FILE_ENDINGS:
                    missing.append("%s: report.%s" % (os.path.basename(doc), name))
            for chain in re.findall(r"GuardOptions\(\)((?:\.\w+\([^()]*\))+)", piece):
                for name in re.findall(r"\.(\w+)\(", chain):
                    if name not in setters:
                        missing.append("%s: GuardOptions().%s()" % (os.path.basename(doc), name))
    assert not missing, sorted(set(missing))


def test_the_first_example_runs_as_written(tmp_path):
    """The README's opening example, unchanged, under one Gloo rank: a tiny model whose forward
    is the loss, a loader with one NaN batch. The guard skips that batch and the model stays
    finite."""
    example = _blocks(_text(DOCS[0]), ("python",))[0][1]
    assert "stepguard.GuardedOptimizer" in example
    program = textwrap.dedent("""\
        import os, socket, torch
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1")
        torch.manual_seed(0)

        class MyModel(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 1)

            def forward(self, batch):
                return ((self.lin(batch) - 1.0) ** 2).mean()

        loader = [torch.randn(8, 4) for _ in range(8)]
        loader[3][0, 0] = float("nan")
        """) + example + textwrap.dedent("""\
        totals = guard.stats().totals
        assert (totals.steps, totals.applied, totals.skipped) == (8, 7, 1), totals
        assert all(torch.isfinite(p).all() for p in model.parameters())
        dist.destroy_process_group()
        print("ok")
        """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [BUILD, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                       timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_policy_list_gives_each_presets_first_sentence_whole():
    """`stepguard policy list`: a line per preset with what it is for, the first sentence of its
    comment whole (wrapped under its column, never cut with "..."), no line over 80 columns."""
    r = subprocess.run([CLI, "policy", "list"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "..." not in r.stdout and max(len(line) for line in lines) <= 80, r.stdout
    entries = {}
    for line in lines:
        if line.startswith(" "):
            entries[name] += " " + line.strip()
        else:
            name, _, text = line.partition(" ")
            entries[name] = text.strip()
    assert sorted(entries) == sorted(stepguard.policy_presets()), entries
    for name, text in entries.items():
        comment = [line[1:] for line in stepguard.policy_presets()[name].splitlines()
                   if line.startswith("#")]
        assert text.endswith(".") and " ".join(" ".join(comment).split()).startswith(text), \
            (name, text)


def _anchor(heading):
    """The anchor a Markdown renderer (GitHub's) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_between_the_docs_resolves_to_a_file_and_heading():
    bad = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", _text(doc), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^(https?|mailto):", target):
                continue
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(path):
                bad.append("%s: %s (no such file)" % (os.path.relpath(doc, ROOT), target))
            elif anchor and path.endswith(".md"):
                body = re.sub(r"^```.*?^```", "", _text(path), flags=re.S | re.M)
                headings = {_anchor(h) for h in re.findall(r"^#+ (.*)$", body, flags=re.M)}
                if anchor not in headings:
                    bad.append("%s: %s (no such heading)" % (os.path.relpath(doc, ROOT), target))
    assert not bad, bad


def test_the_readme_is_short_and_links_every_docs_page():
    """A README a newcomer reads in ten minutes: under 300 lines, install (pip first) before the
    quick start, and every docs/ page linked from it."""
    text = _text(DOCS[0])
    assert len(text.splitlines()) < 300
    assert text.index("pip install") < text.index("make test") < text.index("## Quick start")
    for page in glob.glob(os.path.join(ROOT, "docs", "*.md")):
        assert "](docs/%s)" % os.path.basename(page) in text, page


def test_every_python_block_compiles_and_its_stepguard_imports_import():
    """Every Python block of the README and the docs pages is valid Python, and each snippet's
    imports of stepguard (an integration's module and names included) import, in one fresh
    interpreter with the frameworks this environment pins."""
    imports = set()
    for doc in DOCS:
        for i, (_, body) in enumerate(_blocks(_text(doc), ("python",))):
            compile(body, "%s python block %d" % (os.path.relpath(doc, ROOT), i + 1), "exec")
            for line in body.splitlines():
                if re.match(r"^(from stepguard[\w.]* import |import stepguard)", line):
                    imports.add(line.strip())
    assert any("integrations.torchtitan" in line for line in imports), imports
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([BUILD, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", "\n".join(sorted(imports)) + "\nprint('ok')"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]

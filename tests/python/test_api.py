"""The typed surface: stepguard/_C.pyi describes stepguard._C exactly (every class, method,
property and function in one is in the other), and the public Python API carries type hints.
A live guard tells its active policy (explain_policy(), /policy, stepguard_policy_info)."""

import ast
import inspect
import os
import re
import urllib.request

import torch

import stepguard
from stepguard import _C

STUB = os.path.join(os.path.dirname(stepguard.__file__), "_C.pyi")


def _stub_names():
    tree = ast.parse(open(STUB).read())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    members.add(item.target.id)
            out[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = None
    return out


def _public(cls):
    return {n for n in dir(cls) if not n.startswith("_") or n in ("__init__", "__bool__")}


def test_the_stub_names_what_the_extension_has_and_nothing_else():
    stub = _stub_names()
    module = {n for n in dir(_C) if not n.startswith("_")}
    assert set(stub) == module
    for name, members in stub.items():
        if members is None:
            continue
        cls = getattr(_C, name)
        if issubclass(cls, BaseException):
            continue  # exception attributes are set on instances
        have = _public(cls) - set(dir(object)) | ({"__init__"} if "__init__" in members else set())
        if "__bool__" in members:
            have.add("__bool__")
        assert members == have, name


def test_the_public_python_api_has_type_hints():
    guard = stepguard.GuardedOptimizer
    for name, member in inspect.getmembers(guard):
        if name.startswith("_") and name != "__init__":
            continue
        fn = member.fget if isinstance(member, property) else member
        if not inspect.isfunction(fn) or fn.__module__ != "stepguard._guard":
            continue
        hints = fn.__annotations__
        assert "return" in hints, name


# The C++ GuardedOptimizer's methods and their Python names: the same, except where each language
# follows torch's own optimizers (C++ save/load archives, Python state_dict/load_state_dict).
_CPP_TO_PYTHON = {"save": "state_dict", "load": "load_state_dict"}
# torch.optim.Optimizer's own surface (and ZeroRedundancyOptimizer's consolidate_state_dict),
# passed through to the wrapped optimizer.
_TORCH_OPTIM = {"param_groups", "state", "defaults", "zero_grad", "add_param_group",
                "consolidate_state_dict", "register_step_pre_hook", "register_step_post_hook",
                "register_state_dict_pre_hook", "register_state_dict_post_hook",
                "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook",
                "OptimizerPreHook", "OptimizerPostHook", "profile_hook_step"}
# The guard's own part of a framework's checkpoint (Lightning, HF, DeepSpeed, Megatron keep it
# beside the optimizer's); C++ save/load write both parts in one archive.
# flush(): the deferred verdict's, which needs an optimizer that takes a device found_inf (torch's
# fused Python optimizers); LibTorch's C++ optimizers take none.
_PYTHON_ONLY = {"guard_state_dict", "load_guard_state_dict", "flush"}


def _cpp_public_methods():
    header = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "plugin",
                          "include", "stepguard", "guarded_optimizer.h")
    text = open(header).read()
    public = text[text.index(" public:"):text.index(" private:")]
    names = set()
    for line in public.splitlines():
        line = line.strip()
        if not line or line.startswith("//") or "operator=" in line or "~" in line:
            continue
        head = line.split("(")[0].split()
        if "(" in line and head and head[-1] != "GuardedOptimizer" and not line.startswith(":"):
            names.add(head[-1].lstrip("&*"))
    return names


def test_the_cpp_guard_is_as_narrow_as_torchs_optimizer_and_python_matches_it_name_for_name():
    cpp = _cpp_public_methods()
    # torch's optimizer surface, the guard's own tools (the active policy in words among them),
    # and the step's two phases (verdict, settle, clip_gradients) for frameworks that run their
    # own update.
    assert 12 <= len(cpp) <= 20, sorted(cpp)
    # What the class itself defines, less torch.optim's pass-throughs; the wrapped optimizer is an
    # attribute.
    python = {n for n in vars(stepguard.GuardedOptimizer) if not n.startswith("_")}
    python = (python - _TORCH_OPTIM - _PYTHON_ONLY) | {"optimizer"}
    assert python == {_CPP_TO_PYTHON.get(n, n) for n in cpp}


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.headers.get("Content-Type"), r.read().decode()


def test_a_live_guard_tells_its_active_policy_in_words_and_on_its_endpoint():
    """On-call asks a running job which policy it runs: the guard's explain_policy() is the
    `policy explain` text of that policy, /policy on its metrics endpoint serves it, and
    stepguard_policy_info names its source and digest (the same digest for the same words)."""
    from conftest import make_model
    model = make_model(0)
    guards = [stepguard.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters(), metrics_port=0, **kw)
              for kw in ({"policy": "default"}, {"max_consecutive_bad_steps": 3})]
    words = [g.explain_policy() for g in guards]
    preset = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "configs", "policies", "default.yaml")
    assert words[0] == stepguard.explain_policy_file(preset)
    # The options' ladder: max_consecutive_bad_steps=3 is its one limit.
    assert "Limits:\n  - 3 bad steps in a row: abort training." in words[1], words[1]
    digests = []
    for guard, text, source in zip(guards, words, ("default", "options")):
        url = guard.stats().metrics_endpoint
        kind, body = _get(url.replace("/metrics", "/policy"))
        assert body == text and kind == "text/plain; charset=utf-8", (kind, body)
        info = re.search(r'^stepguard_policy_info\{([^}]*)\} 1$', _get(url)[1], re.M)
        assert info and 'policy="%s"' % source in info.group(1), info
        digests.append(re.search(r'digest="([0-9a-f]{16})"', info.group(1)).group(1))
    assert digests[0] != digests[1]

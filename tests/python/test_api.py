"""The typed surface: stepguard/_C.pyi describes stepguard._C exactly (every class, method,
property and function in one is in the other), and the public Python API carries type hints."""

import ast
import inspect
import os

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

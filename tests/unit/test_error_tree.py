"""The error tree drawn in kvasird/errors.py is the tree in the code: every class kvasird
defines under KvasirError, drawn under its parent with its module, and nothing else
derives from KvasirError directly but the drawn branches."""

from __future__ import annotations

import importlib
import pkgutil
import re

import kvasird
from kvasird import errors
from kvasird.errors import KvasirError

_ENTRY = re.compile(r"((?:│   |    )*)[├└]── (\w+) +([\w.]+) +\S")
"""A class under the root: its depth in the prefix, name, module; a line without the
connector continues the meaning above it."""


def _drawn() -> dict[str, tuple[str, str]]:
    """{class name: (parent's name, module)} as the docstring draws them."""
    lines = (errors.__doc__ or "").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("KvasirError "))
    tree = {"KvasirError": ("Exception", lines[start].split()[1])}
    path = ["KvasirError"]
    for line in lines[start + 1:]:
        if not line.strip():
            break
        if (entry := _ENTRY.match(line)) is None:
            continue
        prefix, name, module = entry.groups()
        del path[len(prefix) // 4 + 1:]
        tree[name] = (path[-1], module)
        path.append(name)
    return tree


def _defined() -> dict[str, type]:
    """Every KvasirError subclass kvasird defines, by name, with every module imported."""
    for module in pkgutil.walk_packages(kvasird.__path__, "kvasird."):
        if module.name != "kvasird.__main__":  # runs the CLI
            importlib.import_module(module.name)
    found: dict[str, type] = {}
    todo = [KvasirError]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("kvasird."):
                assert found.setdefault(sub.__name__, sub) is sub, f"two classes {sub.__name__}"
    return found


def _parent(cls: type) -> type:
    return next(base for base in cls.__bases__ if issubclass(base, KvasirError))


def test_only_the_drawn_branches_derive_from_kvasir_error_directly() -> None:
    branches = {name for name, (parent, _) in _drawn().items() if parent == "KvasirError"}
    direct = {name for name, cls in _defined().items() if _parent(cls) is KvasirError}
    assert direct <= branches, (f"{sorted(direct - branches)} derive from KvasirError directly: "
                                "put them under a branch of the tree in kvasird/errors.py")
    assert {"ConfigError", "PeerError", "ModelError", "SettlementError", "ApiError"} <= branches


def test_every_error_class_is_drawn_under_its_parent_with_its_module() -> None:
    drawn = _drawn()
    for name, cls in _defined().items():
        assert name in drawn, f"{cls.__module__}.{name} is missing from kvasird/errors.py's tree"
        where = (_parent(cls).__name__, cls.__module__.removeprefix("kvasird."))
        assert drawn[name] == where, f"{name}: drawn as (parent, module) {drawn[name]}, is {where}"


def test_the_drawing_shows_no_class_that_is_gone() -> None:
    assert set(_drawn()) - {"KvasirError"} == set(_defined())

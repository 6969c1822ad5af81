"""What pyproject.toml ships is kvasird alone: the developer tools beside it (kvasird_dev,
imported by the tests and benchmarks from the checkout) stay out of the wheel, and nothing
in kvasird imports them, so an installed daemon never needs what it was not given."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_namespace_packages, find_packages

import kvasird

ROOT = Path(kvasird.__file__).parent.parent


def test_the_wheel_ships_every_kvasird_package_and_nothing_beside_it() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    shipped = set(finder(str(ROOT), include=find["include"], exclude=find.get("exclude", ())))
    packages = {".".join(init.parent.relative_to(ROOT).parts)
                for init in (ROOT / "kvasird").rglob("__init__.py")}
    assert packages <= shipped
    assert {p for p in shipped if p.split(".")[0] != "kvasird"} == set()
    assert (ROOT / "kvasird_dev" / "__init__.py").is_file()


def test_no_kvasird_module_imports_the_dev_tools() -> None:
    offenders = []
    for path in sorted((ROOT / "kvasird").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] == "kvasird_dev" for name in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"kvasird imports kvasird_dev, which is not shipped: {offenders}"

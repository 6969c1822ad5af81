"""Every import in kvasird keeps to the layering drawn in the root package's docstring, the
data plane speaks no HTTP, and only the daemon (and ``kvasird run``) builds a Node.

Imports are read from the source, all of them: at module level, inside functions, and under
TYPE_CHECKING, since a deferred import couples packages as much as any other.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import kvasird

ROOT = Path(kvasird.__file__).parent
FOUNDATION = frozenset({"errors", "logs", "kvasird"})
"""What every package may import: the error tree, logging, the root's version numbers."""
ROW = re.compile(r"^ {4}(\w+) +→(.*)$")
"""A line of the drawing: a package, an arrow, the packages it may import."""
MORE = re.compile(r"^ {5,}(\w[\w ]*)$")
"""A drawing line's continuation: more packages it may import."""


def drawing() -> dict[str, list[str]]:
    """The root docstring's layering: each package, in the order drawn, with the packages
    it may import."""
    rows: dict[str, list[str]] = {}
    last = ""
    for line in (kvasird.__doc__ or "").splitlines():
        if row := ROW.match(line):
            last = row[1]
            rows[last] = row[2].split()
        elif last and (more := MORE.match(line)):
            rows[last] += more[1].split()
        elif last:
            last = ""
    return rows


def package_of(module: str) -> str:
    """The package of kvasird a module belongs to (a top-level module is its own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvasird"


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """Every module ``path`` imports, anywhere in it, with its line; a name imported from a
    package is given as the submodule it may be."""
    here = module_of(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*here[:len(here) - node.level + 1], node.module or ""]
                            if node.level else [node.module or ""]).strip(".")
            yield node.lineno, base
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names
                        if is_module(f"{base}.{alias.name}"))


def is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def sources() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def crossings() -> list[str]:
    """Imports of a package its line in the drawing does not name."""
    allowed = drawing()
    out = []
    for path in sources():
        mine = package_of(module_of(path))
        for line, name in imports(path):
            theirs = package_of(name)
            if name.split(".")[0] != "kvasird" or theirs in (mine, *FOUNDATION):
                continue
            if theirs not in allowed.get(mine, ()):
                out.append(f"{path.relative_to(ROOT.parent)}:{line} {mine} → {theirs} ({name})")
    return sorted(set(out))


def test_the_drawing_names_every_package_once_and_points_only_down() -> None:
    rows = drawing()
    order = list(rows)
    packages = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    packages |= {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert set(order) == packages - FOUNDATION | {"errors", "logs"}
    upward = [f"{a} → {b}" for a, deps in rows.items() for b in deps
              if b not in rows or order.index(b) <= order.index(a)]
    assert not upward, f"the drawing points up or to no package: {upward}"


def test_every_import_keeps_to_the_layering_drawn_in_the_root_docstring() -> None:
    assert drawing(), "kvasird/__init__.py draws no layering"
    found = crossings()
    assert not found, "imports across the layering:\n" + "\n".join(found)


def test_the_inference_package_loads_neither_the_gateway_nor_starlette() -> None:
    """The data plane speaks token ids: every module of kvasird.inference imports cleanly
    without HTTP (the admin API's routes and the gateway serve it)."""
    script = ("import importlib, pkgutil, sys\n"
              "import kvasird.inference as inference\n"
              "for m in pkgutil.walk_packages(inference.__path__, 'kvasird.inference.'):\n"
              "    importlib.import_module(m.name)\n"
              "print(sorted(n for n in sys.modules if n.split('.')[0] == 'starlette'\n"
              "             or n.startswith('kvasird.gateway')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_only_the_daemon_and_kvasird_run_import_the_node() -> None:
    """kvasird.daemon.node is the composition root: every other package gets what it needs
    handed to it."""
    allowed = [ROOT / "daemon", ROOT / "cli" / "run.py"]
    found = [f"{path.relative_to(ROOT.parent)}:{line}" for path in sources()
             if not any(path == a or a in path.parents for a in allowed)
             for line, name in imports(path) if name == "kvasird.daemon.node"]
    assert not found, f"modules outside the daemon that import kvasird.daemon.node: {found}"

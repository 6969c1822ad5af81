"""Every module of the package is drawn in its package's docstring map (the cli's commands
in COMMANDS), so that a reader who opens a package finds all of it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvasird
from kvasird.cli import COMMANDS

ROOT = Path(kvasird.__file__).parent


def unmapped(package: Path) -> list[str]:
    """The modules and subpackages of ``package`` its docstring does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    parts = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    parts += [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    if package == ROOT / "cli":
        return sorted(set(parts) - set(COMMANDS))
    return sorted(p for p in parts if not re.search(rf"\b{re.escape(p)}\b", doc))


def test_every_module_is_named_in_its_packages_docstring() -> None:
    missing = {str(init.parent.relative_to(ROOT.parent)): gaps
               for init in sorted(ROOT.rglob("__init__.py"))
               if (gaps := unmapped(init.parent))}
    assert not missing, f"modules no package docstring names: {missing}"

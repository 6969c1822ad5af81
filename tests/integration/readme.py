"""The README's shell blocks, as the tests that run them read them.

A block preceded by ``<!-- walked -->`` is one step of the hobbyist section's network built
by hand, which test_hand_built_network.py runs on four network namespaces; the other
blocks' commands test_readme.py runs against one node. A line ending in ``\\`` goes on on
the next line; ``  #`` starts a comment.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
WALKED = "<!-- walked -->"


@dataclass(frozen=True)
class Line:
    text: str
    """The command, continuation lines joined, without its comment."""
    section: str
    """The text of the last whole-line comment above it in its block ("A: the chain ...")."""


def blocks(walked: bool | None = None) -> list[list[Line]]:
    """The ```sh blocks' lines; only the walked ones (True), only the others (False), or all."""
    out = []
    for mark, body in re.findall(r"(<!-- walked -->\n)?```sh\n(.*?)```", README, re.S):
        if walked is not None and bool(mark) != walked:
            continue
        lines, section = [], ""
        for raw in re.sub(r"\\\n\s*", " ", body).splitlines():
            if raw.strip().startswith("#"):
                section = raw.strip().lstrip("# ")
                continue
            text = raw.split("  #")[0].strip()
            if text:
                lines.append(Line(text, section))
        out.append(lines)
    return out


def commands(walked: bool | None = None) -> list[str]:
    return [line.text for block in blocks(walked) for line in block]


def kvasird_args(line: str) -> list[str] | None:
    """The arguments of a `.venv/bin/kvasird ...` command in ``line`` (None if there is none)."""
    m = re.search(r"\.venv/bin/kvasird\s+(.*)$", line)
    return shlex.split(m.group(1)) if m else None

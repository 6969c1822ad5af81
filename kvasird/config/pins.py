"""[market] hold's pins as written: ``head``, ``layers:A-B``, ``experts:L:A-B``.

The syntax lives with the configuration, so that loading a kvasird.toml refuses a bad pin
before anything starts; the market turns each pin into the units it names
(kvasird.market.pinning).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pin:
    """One pin, parsed: what it names."""

    kind: str
    """"head", "layers" or "experts"."""
    layer: int = 0
    """The layer whose experts are pinned ("experts" only)."""
    first: int = 0
    """The range's first layer or expert."""
    end: int = 0
    """Just past its last: ranges are half-open (``layers:0-10`` is layers 0..9)."""


def parse_pin(text: str) -> Pin:
    parts = text.split(":")
    try:
        if parts == ["head"]:
            return Pin("head")
        if parts[0] == "layers" and len(parts) == 2:
            return Pin("layers", 0, *_range(parts[1]))
        if parts[0] == "experts" and len(parts) == 3:
            return Pin("experts", int(parts[1]), *_range(parts[2]))
    except ValueError:
        pass
    raise ValueError(f'{text!r} is not a pin: write "head", "layers:A-B" or "experts:L:A-B"')


def _range(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split("-"))
    if not 0 <= a < b:
        raise ValueError(text)
    return a, b

"""Operator pinning: ``hold = ["head", "layers:0-10", "experts:3:0-64"]`` in [market]."""

from __future__ import annotations

from kvasird.model.manifest import HEAD, Unit


def parse_hold(text: str) -> list[Unit]:
    """Units named by one pin; ranges are half-open (``layers:0-10`` is layers 0..9)."""
    parts = text.split(":")
    try:
        if parts == ["head"]:
            return [HEAD]
        if parts[0] == "layers" and len(parts) == 2:
            a, b = _range(parts[1])
            return [Unit("layer", i) for i in range(a, b)]
        if parts[0] == "experts" and len(parts) == 3:
            layer = int(parts[1])
            a, b = _range(parts[2])
            return [Unit("expert", layer, e) for e in range(a, b)]
    except ValueError:
        pass
    raise ValueError(f"{text!r} is not a pin: write \"head\", \"layers:A-B\" or \"experts:L:A-B\"")


def _range(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split("-"))
    if not 0 <= a < b:
        raise ValueError(text)
    return a, b

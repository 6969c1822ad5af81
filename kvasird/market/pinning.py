"""Operator pinning: ``hold = ["head", "layers:0-10", "experts:3:0-64"]`` in [market]."""

from __future__ import annotations

from kvasird.config.pins import parse_pin
from kvasird.model.manifest import HEAD, Unit


def parse_hold(text: str) -> list[Unit]:
    """Units named by one pin (its syntax: kvasird.config.pins)."""
    pin = parse_pin(text)
    if pin.kind == "head":
        return [HEAD]
    if pin.kind == "layers":
        return [Unit("layer", i) for i in range(pin.first, pin.end)]
    return [Unit("expert", pin.layer, e) for e in range(pin.first, pin.end)]

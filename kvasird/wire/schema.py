"""Small, strict checks for decoded peer input. Every failure is a WireError naming the field.

Records from peers are plain msgpack values until they pass these checks; only the
validated, frozen record types built from them reach the rest of the daemon.
"""

from __future__ import annotations

from typing import Any

from kvasird.errors import WireError


def mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected a map, got {type(value).__name__}")
    return value


def text(d: dict[str, Any], key: str, max_len: int, what: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > max_len:
        raise WireError(f"{what}.{key}: expected a string of at most {max_len} chars")
    return v


def integer(d: dict[str, Any], key: str, lo: int, hi: int, what: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise WireError(f"{what}.{key}: expected an integer in {lo}..{hi}, got {v!r}")
    return v


def number(d: dict[str, Any], key: str, lo: float, hi: float, what: str) -> float:
    v = d.get(key)
    if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
        raise WireError(f"{what}.{key}: expected a number in {lo}..{hi}, got {v!r}")
    return float(v)


def text_list(
    d: dict[str, Any], key: str, max_items: int, max_len: int, what: str
) -> tuple[str, ...]:
    v = d.get(key)
    if (
        not isinstance(v, list)
        or len(v) > max_items
        or not all(isinstance(s, str) and len(s) <= max_len for s in v)
    ):
        raise WireError(
            f"{what}.{key}: expected at most {max_items} strings of at most {max_len} chars"
        )
    return tuple(v)


def items(d: dict[str, Any], key: str, max_items: int, what: str) -> list[Any]:
    v = d.get(key)
    if not isinstance(v, list) or len(v) > max_items:
        raise WireError(f"{what}.{key}: expected a list of at most {max_items} items")
    return v

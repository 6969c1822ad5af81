"""Loading, validating and rendering kvasird.toml.

Validation is driven by the dataclass fields in ``model``: their type and metadata
(range, choices, pattern, multiaddr, loopback). Every error names the file, the key
and what is allowed, because the operator fixing it has only the message.

A file cut short (a full disk, an interrupted copy) often still parses: cut at a section
boundary, or inside a number, it is valid TOML, and the defaults would fill the rest
(0.0.0.0 listeners, an empty bootstrap list). So the file ``kvasird init`` writes begins
with HEADER and ends with the line END, and a file that begins with HEADER is refused
unless END is its last line; ``render`` keeps END last. Files without HEADER (written by
hand, or by an older init) are only parsed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

from kvasird.config.pins import parse_pin
from kvasird.config.schema import Config, sections
from kvasird.errors import ConfigError

_REPO_DEFAULT = Path(__file__).resolve().parents[2] / "config" / "kvasird.toml"
_INSTALLED_DEFAULT = Path(sys.prefix) / "share" / "kvasird" / "kvasird.toml"

END = "# end of kvasird.toml"
"""The last line of a whole file of the kind init writes."""
HEADER = f'# kvasird configuration; its last line is "{END}"'
"""How such a file begins: a file that begins so must end with END."""


def default_text() -> str:
    """The commented default kvasird.toml (from the source tree, else the installed copy)."""
    for path in (_REPO_DEFAULT, _INSTALLED_DEFAULT):
        if path.is_file():
            return path.read_text()
    raise ConfigError(
        f"the default kvasird.toml is missing (looked in {_REPO_DEFAULT} and "
        f"{_INSTALLED_DEFAULT}): reinstall kvasird"
    )


def load(path: Path) -> Config:
    """Read and validate ``path``; defaults fill keys the file leaves out."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: run `kvasird init` first") from None
    if not text:
        raise _cut_short(str(path), "it is empty, 0 bytes")
    return load_text(text, source=str(path))


def load_text(text: str, source: str = "kvasird.toml") -> Config:
    head = text.strip()
    cut = (
        _last_line(text) != END
        if text.startswith(HEADER)
        else bool(head) and HEADER.startswith(head)
    )
    last = f"line {text.count(chr(10)) + (not text.endswith(chr(10)))}"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        error = str(exc).replace("at end of document", f"at the end, {last}")
        if cut:
            raise _cut_short(source, f"it ends in invalid TOML: {error}") from None
        raise ConfigError(
            f"{source} is not valid TOML ({error}): fix the file or re-create it "
            "with `kvasird init` in an empty directory"
        ) from None
    if cut:
        raise _cut_short(source, f"it ends at {last}, {_last_line(text)[:40]!r}")
    defaults = tomllib.loads(default_text())
    known = sections()
    for name in data:
        if name not in known:
            raise ConfigError(
                f"{source}: unknown section [{name}]; known sections are "
                + ", ".join(f"[{s}]" for s in known)
            )
    built = {}
    for name, cls in known.items():
        merged = {**defaults.get(name, {}), **_table(data.get(name, {}), source, name)}
        built[name] = _section(cls, merged, source, name)
    return Config(**built)


def _last_line(text: str) -> str:
    lines = text.rstrip().splitlines()
    return lines[-1].strip() if lines else ""


def _cut_short(source: str, why: str) -> ConfigError:
    return ConfigError(
        f"{source} was cut short ({why}): restore it from a backup, or complete "
        f"it from {_REPO_DEFAULT if _REPO_DEFAULT.is_file() else _INSTALLED_DEFAULT}"
        f" (what `kvasird init` wrote it from), ending with the line {END!r}"
    )


def _table(value: Any, source: str, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: [{name}] must be a table")
    return value


RETIRED = {"settlement.max_unreceipted"}
"""Keys earlier versions wrote that are no longer read: a file that has them still loads
(max_unreceipted: sessions without a receipt, replaced by the meter's credit of work)."""


def _section(cls: type, values: dict[str, Any], source: str, section: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in values:
        if key not in fields and f"{section}.{key}" not in RETIRED:
            raise ConfigError(
                f"{source}: unknown key {section}.{key}; known keys are " + ", ".join(fields)
            )
    out = {}
    for key, f in fields.items():
        where = f"{source}: {section}.{key}"
        out[key] = _check(values.get(key, f.default), hints[key], dict(f.metadata), where)
    try:
        return cls(**out)
    except ConfigError as exc:  # a check across keys, in the section's __post_init__
        raise ConfigError(f"{source}: {exc}") from None


def _check(value: Any, hint: Any, meta: dict[str, Any], where: str) -> Any:
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        return tuple(_check_str(v, meta, where) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if hint == bool | None:  # a switch whose "auto" (None) the daemon decides as it starts
        if value is None or value == "auto":
            return None
        if not isinstance(value, bool):
            raise ConfigError(f'{where} must be true, false or "auto", got {value!r}')
        return value
    if hint in (int, float):
        ok = isinstance(value, int) if hint is int else isinstance(value, int | float)
        if not ok or isinstance(value, bool):
            raise ConfigError(
                f"{where} must be {'an integer' if hint is int else 'a number'}, got {value!r}"
            )
        lo, hi = meta.get("range", (float("-inf"), float("inf")))
        if not lo <= value <= hi:
            raise ConfigError(f"{where} = {value} is out of range: allowed {lo}..{hi}")
        return hint(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return _check_str(value, meta, where)


def _check_str(value: str, meta: dict[str, Any], where: str) -> str:
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(
            f"{where} = {value!r} is not allowed: use one of "
            + ", ".join(repr(c) for c in meta["choices"])
        )
    if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
        raise ConfigError(f"{where} = {value!r} must match {meta['pattern']}")
    if meta.get("multiaddr"):
        check_multiaddr(value, meta.get("p2p", False), where)
    if meta.get("loopback"):
        _check_loopback(value, where)
    if meta.get("holdings"):
        try:
            parse_pin(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return value


def check_multiaddr(value: str, needs_peer_id: bool, where: str) -> None:
    """Raise a ConfigError unless ``value`` is a multiaddr (ending in /p2p/<peer id> when
    ``needs_peer_id``); its example is one that this check accepts."""
    import multiaddr  # deferred: importing it pulls in a few hundred ms of libp2p helpers

    try:
        addr = multiaddr.Multiaddr(value)
    except Exception as exc:  # noqa: BLE001 - the library raises a zoo of types
        example = EXAMPLE_JOIN if needs_peer_id else EXAMPLE_JOIN.split("/p2p/")[0]
        raise ConfigError(
            f"{where}: {value!r} is not a multiaddr ({exc}); example: {example}"
        ) from None
    if needs_peer_id and "p2p" not in [p.name for p in addr.protocols()]:
        raise ConfigError(
            f"{where}: {value!r} lacks /p2p/<peer id>; copy the full join "
            "address from the other node's banner or `kvasird id`"
        )


EXAMPLE_JOIN = "/ip4/192.0.2.10/tcp/4001/p2p/12D3KooWQLhaHqTr65RWq9gCquhwQJUYkp96yFHBwsjiZjHt2Gqn"
"""A join address as a banner prints one (a documentation address, a well-formed peer id)."""


def _check_loopback(value: str, where: str) -> None:
    host, sep, port = value.rpartition(":")
    try:
        ok = sep and ipaddress.ip_address(host.strip("[]")).is_loopback and 0 <= int(port) < 65536
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"{where} = {value!r} must be a loopback host:port such as "
            "127.0.0.1:5101 (the admin API is never exposed)"
        )


def render(text: str, values: dict[str, Any]) -> str:
    """``text`` with the values of ``{"section.key": value}`` set, comments kept.

    A key the file lacks is added at the end of its section (the section is added
    at the end of the file when missing, before the END line and its comment).
    """
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    todo = dict(values)
    section, section_end = "", {}
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            section = stripped[1:-1]
        elif (
            m := re.match(r"([A-Za-z0-9_]+)\s*=", stripped)
        ) and f"{section}.{m.group(1)}" in todo:
            lines[i] = f"{m.group(1)} = {_toml(todo.pop(f'{section}.{m.group(1)}'))}\n"
        if stripped and not stripped.startswith("#"):
            section_end[section] = i + 1
    new: dict[str, list[str]] = {}
    for dotted, value in reversed(list(todo.items())):
        name, key = dotted.split(".", 1)
        entry = f"{key} = {_toml(value)}\n"
        if name in section_end:
            lines.insert(section_end[name], entry)
        else:
            new.setdefault(name, []).insert(0, entry)
    tail = _tail(lines)
    for name, entries in reversed(list(new.items())):
        lines[tail:tail] = (
            [f"\n[{name}]\n", *entries] if tail == len(lines) else [f"[{name}]\n", *entries, "\n"]
        )
    return "".join(lines)


def _tail(lines: list[str]) -> int:
    """Where new sections go: before the END line and the comments just above it, else
    at the end."""
    filled = [i for i, line in enumerate(lines) if line.strip()]
    if not filled or lines[filled[-1]].strip() != END:
        return len(lines)
    at = filled[-1]
    while at > 0 and lines[at - 1].startswith("#"):
        at -= 1
    return at


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to TOML")

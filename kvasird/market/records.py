"""Gossip records of the market, and their strict wire validation.

A record is a msgpack map. ``from_wire`` turns the decoded value into a frozen record or
raises WireError naming the field; nothing else in the daemon ever sees raw peer input.
Holdings travel as compact ranges:

    ["L", a, b, state]          layers [a, b) (their dense paths)
    ["E", layer, e0, e1, state] experts [e0, e1) of one layer
    ["H", state]                the head
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvasird.errors import WireError
from kvasird.model.manifest import HEAD, Unit
from kvasird.model.names import NAME, NAME_FORM
from kvasird.settlement.errors import WalletError
from kvasird.settlement.wallet import WalletLink
from kvasird.wire import schema

SCHEMA_VERSION = 1
UNIT_STATES = ("joining", "loading", "online", "draining")
"""Per-unit state machine: joining -> loading -> online -> draining (then gone)."""
ACTIVE_STATES = frozenset({"joining", "loading", "online"})
"""States that count as a replica for scarcity (joining ones too: no pile-ups)."""
NODE_STATES = ("joining", "online", "draining", "offline")
REACH = ("public", "private", "unknown")
MAX_HOLDINGS = 4096
MAX_LAYERS = 4096
MAX_EXPERTS = 65536
MAX_LOAD_ENTRIES = 16384
MAX_RECORD_BYTES = 256 * 1024
MAX_NAME = 129
"""A model name's longest form: a 64-character family, ":" and a 64-character tag."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Holding:
    kind: str
    """"L" (layers a..b), "E" (experts of one layer) or "H" (head)."""
    start: int
    """First layer ("L"), the layer ("E"), 0 for the head."""
    lo: int
    """"L": first layer; "E": first expert; "H": 0."""
    hi: int
    """Exclusive end: layer ("L") or expert ("E"); 1 for the head."""
    state: str
    """One of UNIT_STATES."""

    def units(self) -> Iterable[Unit]:
        if self.kind == "H":
            yield HEAD
        elif self.kind == "L":
            yield from (Unit("layer", i) for i in range(self.lo, self.hi))
        else:
            yield from (Unit("expert", self.start, e) for e in range(self.lo, self.hi))

    @property
    def count(self) -> int:
        return self.hi - self.lo

    def to_wire(self) -> list[Any]:
        if self.kind == "H":
            return ["H", self.state]
        if self.kind == "L":
            return ["L", self.lo, self.hi, self.state]
        return ["E", self.start, self.lo, self.hi, self.state]

    @staticmethod
    def from_wire(value: Any) -> Holding:
        if not isinstance(value, list) or not value or value[0] not in ("L", "E", "H"):
            raise WireError('holding: expected ["L"|"E"|"H", ...]')
        kind, state = value[0], value[-1]
        if state not in UNIT_STATES:
            raise WireError(f"holding: state must be one of {UNIT_STATES}")
        nums = value[1:-1]
        want = {"H": 0, "L": 2, "E": 3}[kind]
        if len(nums) != want or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in nums
        ):
            raise WireError(f"holding {kind}: expected {want} integers")
        if kind == "H":
            return Holding("H", 0, 0, 1, state)
        if kind == "L":
            a, b = nums
            if not 0 <= a < b <= MAX_LAYERS:
                raise WireError(f"holding L: bad layer range [{a}, {b})")
            return Holding("L", a, a, b, state)
        layer, e0, e1 = nums
        if not 0 <= layer < MAX_LAYERS or not 0 <= e0 < e1 <= MAX_EXPERTS:
            raise WireError(f"holding E: bad range layer {layer} experts [{e0}, {e1})")
        return Holding("E", layer, e0, e1, state)


def compress(units: dict[Unit, str]) -> tuple[Holding, ...]:
    """Units with states -> the fewest ranges (consecutive units in the same state merge)."""
    out: list[Holding] = []
    for unit in sorted(units):
        state = units[unit]
        last = out[-1] if out else None
        if unit.kind == "head":
            out.append(Holding("H", 0, 0, 1, state))
        elif unit.kind == "layer":
            if last and last.kind == "L" and last.hi == unit.layer and last.state == state:
                out[-1] = Holding("L", last.start, last.lo, unit.layer + 1, state)
            else:
                out.append(Holding("L", unit.layer, unit.layer, unit.layer + 1, state))
        elif (
            last
            and last.kind == "E"
            and last.start == unit.layer
            and last.hi == unit.expert
            and last.state == state
        ):
            out[-1] = Holding("E", unit.layer, last.lo, unit.expert + 1, state)
        else:
            out.append(Holding("E", unit.layer, unit.expert, unit.expert + 1, state))
    return tuple(out)


@dataclass(frozen=True)
class Capabilities:
    backend: str = "CPU"
    """ggml backend the node computes on."""
    precision: str = "f32"
    """Accumulation precision."""
    verdict: str = "unverified"
    """Numerics verdict: "pass", "fail" or "unverified"."""
    threads: int = 1
    """Compute threads."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "precision": self.precision,
            "verdict": self.verdict,
            "threads": self.threads,
        }

    @staticmethod
    def from_wire(value: Any) -> Capabilities:
        d = schema.mapping(value, "caps")
        verdict = schema.text(d, "verdict", 16, "caps")
        if verdict not in ("pass", "fail", "unverified"):
            raise WireError("caps.verdict: expected pass, fail or unverified")
        return Capabilities(
            schema.text(d, "backend", 32, "caps"),
            schema.text(d, "precision", 16, "caps"),
            verdict,
            schema.integer(d, "threads", 1, 4096, "caps"),
        )


@dataclass(frozen=True)
class CoverageRecord:
    peer: str
    """Peer id of the sender; must equal the gossip message's signer."""
    seq: int
    """Strictly increasing per peer (restarts continue from the persisted value)."""
    ts: float
    """Sender's unix time; rejected when too far from ours."""
    ttl: float
    """Seconds this record stays valid without a newer one."""
    state: str
    """Node state: joining, online, draining, offline."""
    protocol: int
    """Wire protocol version."""
    version: str
    """kvasird version."""
    addrs: tuple[str, ...]
    """Dialable addresses."""
    model: str
    """Model id (hex sha256) the holdings refer to; "" when holding nothing."""
    budget: int
    """Bytes the node offers to hold (its memory budget)."""
    holdings: tuple[Holding, ...]
    """What it holds, as ranges with per-range state."""
    caps: Capabilities = field(default_factory=Capabilities)
    """Backend, precision, numerics verdict."""
    link: WalletLink | None = None
    """The node's payout wallet, as the wallet's signed statement that it pays ``peer``
    (verified on parse): what a serving peer checks a gateway's stake and receipts by.
    None: the node takes no part in settlement."""
    has_all: bool = False
    """The node stores every byte of ``model`` and serves any shard of it."""
    reach: str = "unknown"
    """Dial-back verdict: "public", "private" (reached through its /p2p-circuit
    addresses) or "unknown"; optional on the wire, so older records still parse."""
    boot: str = ""
    """Random id of the sender's process start: a new one tells peers it restarted (and so
    forgives the failures its old process had). Optional on the wire; "" from older nodes."""
    name: str = ""
    """The model's name as the sender lists it (``family:tag``, model.names): how a node
    that got the model by id, or asks for it by name, learns what to call it. Optional on
    the wire; "" from older nodes and for an unnamed model."""
    adopted: bool = False
    """The sender took ``name`` from its peers' records rather than chose it (imported the
    file or named the model): counted only where no holder that chose a name is heard
    (``names.agreed_name``)."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "peer": self.peer,
            "seq": self.seq,
            "ts": self.ts,
            "all": self.has_all,
            "ttl": self.ttl,
            "state": self.state,
            "protocol": self.protocol,
            "version": self.version,
            "addrs": list(self.addrs),
            "model": self.model,
            "budget": self.budget,
            "holdings": [h.to_wire() for h in self.holdings],
            "caps": self.caps.to_wire(),
            "reach": self.reach,
            "wallet": str(self.link.wallet) if self.link else "",  # read by older peers
            **({"link": self.link.to_wire()} if self.link is not None else {}),
            **({"boot": self.boot} if self.boot else {}),
            **({"name": self.name} if self.name else {}),
            **({"adopted": True} if self.adopted else {}),
        }

    @staticmethod
    def from_wire(value: Any) -> CoverageRecord:
        d = schema.mapping(value, "coverage")
        if d.get("v") != SCHEMA_VERSION:
            raise WireError(f"coverage.v: unsupported schema version {d.get('v')!r}")
        state = schema.text(d, "state", 16, "coverage")
        if state not in NODE_STATES:
            raise WireError(f"coverage.state: expected one of {NODE_STATES}")
        model = schema.text(d, "model", 64, "coverage")
        if model and not _HEX64.fullmatch(model):
            raise WireError("coverage.model: expected a hex sha256")
        holdings = tuple(
            Holding.from_wire(h) for h in schema.items(d, "holdings", MAX_HOLDINGS, "coverage")
        )
        if holdings and not model:
            raise WireError("coverage.holdings given without a model id")
        name = _name(d)
        adopted = _flag(d, "adopted")
        if name and not model:
            raise WireError("coverage.name given without a model id")
        if adopted and not name:
            raise WireError("coverage.adopted given without a name")
        return CoverageRecord(
            peer=schema.text(d, "peer", 128, "coverage"),
            seq=schema.integer(d, "seq", 0, 2**62, "coverage"),
            ts=schema.number(d, "ts", 0, 2**40, "coverage"),
            ttl=schema.number(d, "ttl", 1, 3600, "coverage"),
            state=state,
            protocol=schema.integer(d, "protocol", 0, 1 << 16, "coverage"),
            version=schema.text(d, "version", 32, "coverage"),
            addrs=schema.text_list(d, "addrs", 16, 256, "coverage"),
            model=model,
            budget=schema.integer(d, "budget", 0, 2**50, "coverage"),
            holdings=holdings,
            caps=Capabilities.from_wire(d.get("caps")),
            link=_link(d),
            has_all=_flag(d, "all"),
            reach=_reach(d),
            boot=schema.text(d, "boot", 32, "coverage") if "boot" in d else "",
            name=name,
            adopted=adopted,
        )

    def units(self) -> dict[Unit, str]:
        return {u: h.state for h in self.holdings for u in h.units()}


def _link(d: dict[str, Any]) -> WalletLink | None:
    """The record's wallet link, signature checked; it must name the record's own peer."""
    if "link" not in d:
        return None
    raw = schema.mapping(d["link"], "coverage.link")
    try:
        link = WalletLink.from_wire(
            {
                k: schema.text(raw, k, 128, "coverage.link")
                for k in ("peer_id", "network", "wallet", "signature")
            }
        )
    except WalletError as exc:
        raise WireError(f"coverage.link: {exc}") from None
    if link.peer_id != d.get("peer"):
        raise WireError("coverage.link: the wallet link is for another peer")
    return link


def _name(d: dict[str, Any]) -> str:
    """The record's model name: absent, or a name in its canonical form (lower case)."""
    if "name" not in d:
        return ""
    name = schema.text(d, "name", MAX_NAME, "coverage")
    if not NAME.fullmatch(name):
        raise WireError(f"coverage.name: {NAME_FORM}")
    return name


def _reach(d: dict[str, Any]) -> str:
    v = d.get("reach", "unknown")
    if v not in REACH:
        raise WireError(f"coverage.reach: expected one of {REACH}")
    return str(v)


def _flag(d: dict[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise WireError(f"coverage.{key}: expected true or false")
    return v


@dataclass(frozen=True)
class LoadReport:
    peer: str
    """Reporting stage's peer id (the gossip signer)."""
    seq: int
    """Strictly increasing per peer."""
    ts: float
    """Sender's unix time."""
    model: str
    """Model id the counts refer to."""
    window_s: float
    """Seconds of traffic the counts cover."""
    tokens: int
    """Tokens the stage processed in the window."""
    experts: tuple[tuple[int, int, int], ...]
    """(layer, expert, times selected) for experts selected in the window."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "peer": self.peer,
            "seq": self.seq,
            "ts": self.ts,
            "model": self.model,
            "window_s": self.window_s,
            "tokens": self.tokens,
            "experts": [list(e) for e in self.experts],
        }

    @staticmethod
    def from_wire(value: Any) -> LoadReport:
        d = schema.mapping(value, "load")
        if d.get("v") != SCHEMA_VERSION:
            raise WireError(f"load.v: unsupported schema version {d.get('v')!r}")
        model = schema.text(d, "model", 64, "load")
        if not _HEX64.fullmatch(model):
            raise WireError("load.model: expected a hex sha256")
        experts = []
        for item in schema.items(d, "experts", MAX_LOAD_ENTRIES, "load"):
            if (
                not isinstance(item, list)
                or len(item) != 3
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in item)
                or item[0] >= MAX_LAYERS
                or item[1] >= MAX_EXPERTS
                or item[2] > 2**40
            ):
                raise WireError("load.experts: expected [layer, expert, count] of small naturals")
            experts.append((item[0], item[1], item[2]))
        return LoadReport(
            peer=schema.text(d, "peer", 128, "load"),
            seq=schema.integer(d, "seq", 0, 2**62, "load"),
            ts=schema.number(d, "ts", 0, 2**40, "load"),
            model=model,
            window_s=schema.number(d, "window_s", 0.1, 86400, "load"),
            tokens=schema.integer(d, "tokens", 0, 2**40, "load"),
            experts=tuple(experts),
        )


@dataclass(frozen=True)
class Suspicion:
    peer: str
    """The accuser's peer id (the gossip signer)."""
    seq: int
    """Strictly increasing per accuser."""
    ts: float
    """Accuser's unix time."""
    suspect: str
    """The peer whose connection failed under the accuser's eyes."""
    of: int
    """The suspect's last sequence number the accuser had: a newer record refutes it."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "peer": self.peer,
            "seq": self.seq,
            "ts": self.ts,
            "suspect": self.suspect,
            "of": self.of,
        }

    @staticmethod
    def from_wire(value: Any) -> Suspicion:
        d = schema.mapping(value, "suspicion")
        if d.get("v") != SCHEMA_VERSION:
            raise WireError(f"suspicion.v: unsupported schema version {d.get('v')!r}")
        return Suspicion(
            peer=schema.text(d, "peer", 128, "suspicion"),
            seq=schema.integer(d, "seq", 0, 2**62, "suspicion"),
            ts=schema.number(d, "ts", 0, 2**40, "suspicion"),
            suspect=schema.text(d, "suspect", 128, "suspicion"),
            of=schema.integer(d, "of", 0, 2**62, "suspicion"),
        )

"""The p2p layer's messages, each a frozen type with its wire form (the hello is hello.py's).

    heartbeat  Ping  {op: ping, n}              Pong {op: pong, n}       every interval
    px         PeersAsk {op: "px?"}          ─▶ Peers {peers: [{id, addrs}]}
    dialback   DialBackAsk {op: "dialback?", addrs} ─▶ Reached {reached: [addr]}
    addrs      AddrsPush {op: addrs, addrs}    (no answer)

``from_wire`` takes a decoded frame and returns the message or raises WireError naming the
field; what depends on who sent it (an address must end in the sender's own id, a reached
address must be one we asked about) the service checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasird.errors import WireError
from kvasird.p2p.hello import MAX_ADDR_LEN, MAX_ADDRS
from kvasird.wire import schema
from kvasird.wire.protocols import OP

MAX_PEERS_PER_REPLY = 64
MAX_PROBED = 8
"""Most addresses one dial-back request may ask a peer to dial."""
MAX_N = 1 << 62
"""Largest heartbeat counter (one a second lasts far longer than any node)."""


def request(value: Any, op: str, what: str) -> dict[str, Any]:
    """`value` as the map of a request of type `op` (WireError otherwise)."""
    d = schema.mapping(value, what)
    if d.get(OP) != op:
        raise WireError(f"{what}.{OP}: expected {op!r}, got {d.get(OP)!r:.40}")
    return d


@dataclass(frozen=True)
class Ping:
    """A heartbeat: the peer answers Pong with the same `n` (a late pong is not this one's)."""

    n: int
    """Counts the heartbeats of one stream from 1."""

    def to_wire(self) -> dict[str, Any]:
        return {OP: "ping", "n": self.n}

    @staticmethod
    def from_wire(value: Any) -> Ping:
        return Ping(schema.integer(request(value, "ping", "ping"), "n", 0, MAX_N, "ping"))


@dataclass(frozen=True)
class Pong:
    """The answer to the Ping of the same `n`."""

    n: int
    """The ping's counter."""

    def to_wire(self) -> dict[str, Any]:
        return {OP: "pong", "n": self.n}

    @staticmethod
    def from_wire(value: Any) -> Pong:
        return Pong(schema.integer(request(value, "pong", "pong"), "n", 0, MAX_N, "pong"))


@dataclass(frozen=True)
class PeersAsk:
    """Whom do you know? (peer exchange)"""

    def to_wire(self) -> dict[str, Any]:
        return {OP: "px?"}

    @staticmethod
    def from_wire(value: Any) -> PeersAsk:
        request(value, "px?", "px")
        return PeersAsk()


@dataclass(frozen=True)
class Peers:
    """The peers a node knows, with their addresses."""

    peers: tuple[tuple[str, tuple[str, ...]], ...]
    """(peer id, its addresses); as received, only the addresses ending in that id."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "peers": [
                {"id": pid, "addrs": list(addrs)} for pid, addrs in self.peers[:MAX_PEERS_PER_REPLY]
            ]
        }

    @staticmethod
    def from_wire(value: Any) -> Peers:
        d = schema.mapping(value, "px")
        out = []
        for item in schema.items(d, "peers", MAX_PEERS_PER_REPLY, "px"):
            entry = schema.mapping(item, "px.peers[]")
            pid = schema.text(entry, "id", 128, "px.peers[]")
            addrs = schema.text_list(entry, "addrs", MAX_ADDRS, MAX_ADDR_LEN, "px.peers[]")
            out.append((pid, tuple(a for a in addrs if a.endswith(f"/p2p/{pid}"))))
        return Peers(tuple(out))


@dataclass(frozen=True)
class DialBackAsk:
    """Dial these addresses of mine and say which you reached."""

    addrs: tuple[str, ...]
    """The asker's direct addresses (the peer dials only those at the IP it sees)."""

    def to_wire(self) -> dict[str, Any]:
        return {OP: "dialback?", "addrs": list(self.addrs)}

    @staticmethod
    def from_wire(value: Any) -> DialBackAsk:
        d = request(value, "dialback?", "dialback")
        return DialBackAsk(schema.text_list(d, "addrs", MAX_PROBED, MAX_ADDR_LEN, "dialback"))


@dataclass(frozen=True)
class Reached:
    """The addresses of a DialBackAsk that the peer dialled and handshook."""

    reached: tuple[str, ...]
    """Each one an address the asker sent."""

    def to_wire(self) -> dict[str, Any]:
        return {"reached": list(self.reached)}

    @staticmethod
    def from_wire(value: Any) -> Reached:
        d = schema.mapping(value, "dialback")
        return Reached(schema.text_list(d, "reached", MAX_PROBED, MAX_ADDR_LEN, "dialback"))


@dataclass(frozen=True)
class AddrsPush:
    """The sender's new address list (it gained or lost a relay reservation)."""

    addrs: tuple[str, ...]
    """Its addresses; the receiver keeps those ending in the sender's own id."""

    def to_wire(self) -> dict[str, Any]:
        return {OP: "addrs", "addrs": list(self.addrs[:MAX_ADDRS])}

    @staticmethod
    def from_wire(value: Any) -> AddrsPush:
        d = request(value, "addrs", "addrs")
        return AddrsPush(schema.text_list(d, "addrs", MAX_ADDRS, MAX_ADDR_LEN, "addrs"))

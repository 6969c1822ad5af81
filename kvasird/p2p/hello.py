"""The hello a node sends first on its heartbeat stream: who it is and where to reach it.

Peers on another network or wire protocol version are disconnected right after
the hello: they are never routed to or served (DESIGN.md, compatibility gating).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasird.wire import schema
from kvasird.wire.protocols import OP

MAX_ADDRS = 16
MAX_ADDR_LEN = 256


@dataclass(frozen=True)
class Hello:
    network: str
    """Network name; must equal ours."""
    protocol: int
    """Wire protocol version; must equal ours."""
    version: str
    """kvasird version (informational)."""
    addrs: tuple[str, ...]
    """Dialable addresses of the sender, each ending in /p2p/<id>."""

    def to_wire(self) -> dict[str, Any]:
        return {
            OP: "hello",
            "network": self.network,
            "protocol": self.protocol,
            "version": self.version,
            "addrs": list(self.addrs),
        }

    @staticmethod
    def from_wire(value: Any, sender: str) -> Hello:
        d = schema.mapping(value, "hello")
        addrs = schema.text_list(d, "addrs", MAX_ADDRS, MAX_ADDR_LEN, "hello")
        suffix = f"/p2p/{sender}"
        return Hello(
            network=schema.text(d, "network", 64, "hello"),
            protocol=schema.integer(d, "protocol", 0, 1 << 16, "hello"),
            version=schema.text(d, "version", 32, "hello"),
            # A peer may only announce addresses for itself.
            addrs=tuple(a for a in addrs if a.endswith(suffix)),
        )

"""Every peer protocol id and gossip topic of a node, under one naming pattern.

A stream protocol is ``/kvasir/<name>/<version>``, a gossip topic ``<name>`` (the node's
gossip puts it under ``kvasir/<network>/``); the constant is ``<NAME>_PROTOCOL`` or
``<NAME>_TOPIC``. A module that serves, dials, publishes or subscribes imports the
constant from here and never spells the string itself, so this file is the whole list of
what a node speaks (a wire change starts here, and PROTOCOL_VERSION goes up with it).

Every frame is a frozen message type with ``from_wire``/``to_wire``; one key, ``op``,
names a request's type (a reply is typed by the request it answers; a channel adds its
own ``id``). Each entry of PROTOCOLS and TOPICS lists its frames' types as
``"module:Type"``: this package sits below every protocol's own, so it names them rather
than imports them; tests/unit/test_protocols.py resolves every name, round-trips
every type, and checks that the package serves exactly these ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from libp2p.custom_types import TProtocol

OP = "op"
"""The key naming a request's message type, in every protocol."""


def protocol(name: str, version: int = 1) -> TProtocol:
    """The id of the stream protocol `name` (the one pattern every id follows)."""
    return TProtocol(f"/kvasir/{name}/{version}")


STAGE_PROTOCOL = protocol("stage")
EXPERT_PROTOCOL = protocol("experts")
SETTLE_PROTOCOL = protocol("settle")
SHARD_PROTOCOL = protocol("shard")
HEARTBEAT_PROTOCOL = protocol("heartbeat")
PX_PROTOCOL = protocol("px")
DIALBACK_PROTOCOL = protocol("dialback")
ADDRS_PROTOCOL = protocol("addrs")
SYNC_PROTOCOL = protocol("coverage-sync")
GOODBYE_PROTOCOL = protocol("goodbye")

COVERAGE_TOPIC = "coverage"
LOAD_TOPIC = "load"
SUSPECT_TOPIC = "suspicion"
UNFIT_TOPIC = "unfit"
GOVERNANCE_TOPIC = "governance"


@dataclass(frozen=True)
class Spec:
    """One protocol id or topic and the types of its frames."""

    name: str
    """The protocol id, or the topic's name."""
    messages: tuple[str, ...]
    """``"module:Type"`` of each frozen type its frames are (from_wire/to_wire)."""


def _of(module: str, *types: str) -> tuple[str, ...]:
    return tuple(f"kvasird.{module}:{t}" for t in types)


_LANE = _of("inference.transport.lane", "LaneAsk", "LaneOffer")
"""The lane offer, asked on every channel protocol whose server has lanes."""

PROTOCOLS: tuple[Spec, ...] = (
    Spec(
        STAGE_PROTOCOL,
        _of(
            "inference.protocol.stage",
            "Open",
            "Step",
            "Close",
            "Ping",
            "Result",
            "Failure",
            "Hidden",
            "Opened",
            "Pong",
            "Closed",
        )
        + _LANE,
    ),
    Spec(EXPERT_PROTOCOL, _of("inference.protocol.experts", "ExpertRequest", "Outputs") + _LANE),
    Spec(
        SETTLE_PROTOCOL,
        _of("settlement.exchange", "ReceiptDelivery", "Noted", "Claim", "Paid") + _LANE,
    ),
    Spec(SHARD_PROTOCOL, _of("model.transfer", "ManifestAsk", "ReadAsk", "ProveAsk", "Header")),
    Spec(HEARTBEAT_PROTOCOL, _of("p2p.hello", "Hello") + _of("p2p.messages", "Ping", "Pong")),
    Spec(PX_PROTOCOL, _of("p2p.messages", "PeersAsk", "Peers")),
    Spec(DIALBACK_PROTOCOL, _of("p2p.messages", "DialBackAsk", "Reached")),
    Spec(ADDRS_PROTOCOL, _of("p2p.messages", "AddrsPush")),
    # Coverage records pass from peer to peer as their signers' gossip messages (the
    # signature spans those bytes): a sync sends lists of them, a goodbye one.
    Spec(SYNC_PROTOCOL, _of("market.records", "CoverageRecord")),
    Spec(GOODBYE_PROTOCOL, _of("market.records", "CoverageRecord")),
)
"""Every stream protocol a node serves."""

TOPICS: tuple[Spec, ...] = (
    Spec(COVERAGE_TOPIC, _of("market.records", "CoverageRecord")),
    Spec(LOAD_TOPIC, _of("market.records", "LoadReport")),
    Spec(SUSPECT_TOPIC, _of("market.records", "Suspicion")),
    Spec(UNFIT_TOPIC, _of("inference.verdicts", "Verdict")),
    Spec(GOVERNANCE_TOPIC, _of("settlement.governance", "GovernanceMessage")),
)
"""Every gossip topic a node publishes or subscribes to."""

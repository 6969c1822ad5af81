"""One shape for every peer protocol: each id and topic is listed once (wire.protocols),
each frame is a frozen type with from_wire/to_wire, and no exchange sends a bare dict.

The rule, checked here: every listed type resolves, is a frozen dataclass with from_wire
and to_wire, and (for the exchanges' own frames) round-trips, a request naming its type
under OP; no module of the package spells a protocol id or a topic, or hands a dict
display to the framing or a channel (only the channel adds its id to a message's wire
form); every listed id is one the package uses; and a running p2p node serves exactly
the p2p layer's listed ids besides libp2p's own.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from solders.keypair import Keypair

import kvasird
from kvasird.config import P2PConfig
from kvasird.errors import KvasirError, WireError
from kvasird.identity.nodekey import create_node_key
from kvasird.inference.transport.lane import LaneAsk, LaneOffer
from kvasird.model.transfer import Header, ManifestAsk, ProveAsk, ReadAsk
from kvasird.p2p import P2PNode
from kvasird.p2p.hello import Hello
from kvasird.p2p.messages import AddrsPush, DialBackAsk, Peers, PeersAsk, Ping, Pong, Reached
from kvasird.settlement.exchange import Claim, Noted, Paid, ReceiptDelivery
from kvasird.settlement.receipts import Receipt, receipt_body
from kvasird.wire.protocols import (
    ADDRS_PROTOCOL,
    DIALBACK_PROTOCOL,
    HEARTBEAT_PROTOCOL,
    OP,
    PROTOCOLS,
    PX_PROTOCOL,
    TOPICS,
    Spec,
)

ROOT = Path(kvasird.__file__).parent
CHANNEL_MODULES = {"inference/transport/channel.py", "wire/rpc.py"}
"""Where a message's wire form gets the channel's own id (and an error reply its code)."""
PID = "12D3KooWExample"
ADDR = f"/ip4/192.0.2.1/tcp/4001/p2p/{PID}"


def resolve(ref: str) -> type:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def receipt() -> Receipt:
    """A receipt signed by a gateway's wallet, as Rewards.receipt makes it."""
    wallet = Keypair()
    fields = ("localnet", wallet.pubkey(), PID, 7, 3, 120, 2)
    return Receipt(*fields, wallet.sign_message(receipt_body(*fields)))


SAMPLES: dict[type, Any] = {
    Hello: Hello("localnet", 2, "0.1.0", (ADDR,)),
    Ping: Ping(3), Pong: Pong(3),
    PeersAsk: PeersAsk(), Peers: Peers(((PID, (ADDR,)),)),
    DialBackAsk: DialBackAsk((ADDR,)), Reached: Reached((ADDR,)),
    AddrsPush: AddrsPush((ADDR,)),
    ManifestAsk: ManifestAsk("ab" * 32), ReadAsk: ReadAsk("ab" * 32, (("t", 0, 0, 16),)),
    ProveAsk: ProveAsk("ab" * 32, b"n" * 32, (("t", 1, 4, 8),)),
    Header: Header(32),
    LaneAsk: LaneAsk(), LaneOffer: LaneOffer(4011, b"t" * 16, b"k" * 32),
    Noted: Noted(), Claim: Claim({"link": {"peer_id": PID}}), Paid: Paid("sig", 120),
}
"""One message of each type the exchanges that sent dicts now send (ReceiptDelivery is
built per test: its receipt is signed)."""
REQUESTS = (Ping, Pong, PeersAsk, DialBackAsk, AddrsPush, ManifestAsk, ReadAsk, ProveAsk,
            LaneAsk, Claim, ReceiptDelivery, Hello)
"""Types that open an exchange (or, on the heartbeat stream, travel either way)."""


def every_spec() -> list[Spec]:
    return [*PROTOCOLS, *TOPICS]


def test_every_protocol_id_and_topic_follows_the_one_pattern_once() -> None:
    ids = [s.name for s in PROTOCOLS]
    topics = [s.name for s in TOPICS]
    assert len(set(ids)) == len(ids) and len(set(topics)) == len(topics)
    assert all(re.fullmatch(r"/kvasir/[a-z-]+/\d+", i) for i in ids), ids
    assert all(re.fullmatch(r"[a-z-]+", t) for t in topics), topics


@pytest.mark.parametrize("spec", every_spec(), ids=lambda s: s.name)
def test_every_frame_of_every_protocol_is_a_frozen_type_with_its_wire_form(spec: Spec) -> None:
    assert spec.messages, f"{spec.name} lists no message types"
    for ref in spec.messages:
        kind = resolve(ref)
        assert dataclasses.is_dataclass(kind), f"{ref} is not a dataclass"
        params = kind.__dataclass_params__  # type: ignore[attr-defined]
        assert params.frozen, f"{ref} is not frozen"
        assert callable(getattr(kind, "from_wire", None)), f"{ref} has no from_wire"
        assert callable(getattr(kind, "to_wire", None)), f"{ref} has no to_wire"


def test_the_samples_cover_every_frame_of_the_exchanges_that_sent_dicts() -> None:
    typed = {resolve(r) for s in PROTOCOLS for r in s.messages
             if r.startswith(("kvasird.p2p.", "kvasird.model.", "kvasird.settlement.",
                              "kvasird.inference.transport."))}
    assert typed == {*SAMPLES, ReceiptDelivery}


@pytest.mark.parametrize("message", list(SAMPLES.values()), ids=lambda m: type(m).__name__)
def test_every_frame_round_trips_through_its_wire_form(message: Any) -> None:
    wire = message.to_wire()
    assert isinstance(wire, dict)
    back = type(message).from_wire(wire, PID) if isinstance(message, Hello) \
        else type(message).from_wire(wire)
    assert back == message
    assert (OP in wire) == isinstance(message, REQUESTS)


def test_a_receipt_delivery_round_trips_with_its_signed_receipt() -> None:
    delivery = ReceiptDelivery(receipt())
    wire = delivery.to_wire()
    assert wire[OP] == "receipt"
    assert ReceiptDelivery.from_wire(wire) == delivery


@pytest.mark.parametrize(("kind", "frame", "field"), [
    (Ping, {OP: "ping", "n": "1"}, "ping.n"),
    (Ping, {"t": "ping", "n": 1}, "ping.op"),
    (Pong, [1], "pong"),
    (PeersAsk, {OP: "dialback?"}, "px.op"),
    (Peers, {"peers": [{"id": PID}]}, "px.peers[].addrs"),
    (DialBackAsk, {OP: "dialback?", "addrs": [ADDR] * 9}, "dialback.addrs"),
    (Reached, {"reached": "all"}, "dialback.reached"),
    (AddrsPush, {OP: "addrs", "addrs": [1]}, "addrs.addrs"),
    (ReadAsk, {OP: "read", "model": "m", "ranges": []}, "shard.ranges"),
    (ProveAsk, {OP: "prove", "model": "m", "nonce": b"x", "ranges": [["t", 0, 0, 1]]},
     "shard.nonce"),
    (Header, {"ok": True, "len": -1}, "shard response header.len"),
    (LaneAsk, {OP: "step"}, "lane.op"),
    (LaneOffer, {"port": 0, "token": b"t" * 16, "key": b"k" * 32}, "lane offer.port"),
    (LaneOffer, {"port": 1, "token": b"t", "key": b"k" * 32}, "lane offer.token"),
    (Claim, {OP: "claim"}, "settle.claim.link"),
    (Paid, {"amount": 1}, "settle.paid.signature"),
    (ReceiptDelivery, {OP: "receipt", "receipt": "x"}, "settle.receipt"),
])
def test_a_malformed_frame_is_refused_naming_its_field(kind: type, frame: Any,
                                                       field: str) -> None:
    with pytest.raises(WireError, match=re.escape(field)):
        kind.from_wire(frame)


def test_a_forged_receipt_is_refused_as_the_settlement_refuses_it() -> None:
    wire = {**ReceiptDelivery(receipt()).to_wire()}
    wire["receipt"] = {**wire["receipt"], "amount": 10**6}
    with pytest.raises(KvasirError):
        ReceiptDelivery.from_wire(wire)


@functools.cache
def package_sources() -> list[tuple[str, ast.Module]]:
    """Every module of the package, parsed once for all the checks that read them."""
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text()))
            for p in sorted(ROOT.rglob("*.py"))]


def docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function, field)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    out.add(id(stmt.value))
    return out


def test_no_module_spells_a_protocol_id_or_a_topic_outside_the_list() -> None:
    ids = {s.name for s in PROTOCOLS}
    topics = {s.name for s in TOPICS}
    gossip_calls = {"publish", "subscribe", "set_validator", "topic", "check"}
    found = []
    for path, tree in package_sources():
        if path == "wire/protocols.py":
            continue
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in skip and node.value in ids:
                found.append(f"{path}:{node.lineno} {node.value}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in gossip_calls and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in topics):
                found.append(f"{path}:{node.lineno} topic {node.args[0].value}")
    assert not found, found


def test_every_listed_protocol_and_topic_is_one_the_package_uses() -> None:
    import kvasird.wire.protocols as listed
    names = {k for k, v in vars(listed).items()
             if isinstance(v, str) and v in {s.name for s in every_spec()}}
    used: set[str] = set()
    for path, tree in package_sources():
        if path == "wire/protocols.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "kvasird.wire.protocols":
                used |= {a.name for a in node.names}
    assert names <= used, f"listed, used nowhere: {sorted(names - used)}"


def test_no_exchange_hands_a_bare_dict_to_the_framing_or_a_channel() -> None:
    senders = {"write_frame": 1, "frame": 0, "request": 2, "notify": 2}
    found = []
    for path, tree in package_sources():
        if path in CHANNEL_MODULES:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", "")
            at = senders.get(name)
            if at is not None and len(node.args) > at and \
                    isinstance(node.args[at], ast.Dict | ast.DictComp):
                found.append(f"{path}:{node.lineno} {name}")
    assert not found, f"dict frames: {found}"


@pytest.mark.slow  # a real libp2p host on loopback
async def test_a_running_p2p_node_serves_exactly_its_listed_protocols(tmp_path: Path) -> None:
    config = P2PConfig(mdns=False, listen=("/ip4/127.0.0.1/tcp/0",))  # type: ignore[arg-type]
    node = P2PNode(create_node_key(tmp_path / "node.key"), config,
                   "protocoltest", sqlite3.connect(":memory:"))
    async with node.running():
        served = {str(p) for p in node.host.get_mux().handlers}
    ours = {p for p in served if p.startswith("/kvasir/")}
    assert ours == {HEARTBEAT_PROTOCOL, PX_PROTOCOL, DIALBACK_PROTOCOL, ADDRS_PROTOCOL}
    assert ours <= {s.name for s in PROTOCOLS}

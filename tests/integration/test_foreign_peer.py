"""What a foreign peer's bytes can do to a node: end its own stream, never the daemon."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import trio
from fuzz_peer import FuzzPeer, generate_ok, start_target  # type: ignore[import-not-found]
from gossip_peer import GossipPeer  # type: ignore[import-not-found]

from kvasird.localnet import LocalNet

pytestmark = pytest.mark.slow

MALFORMED_RPCS = [
    b"\xff" * 64,                      # wire type 7: protobuf's DecodeError
    b"\x0a\xff\xff\xff\xff\x0f",       # a field longer than the message
    b"\x12\x05\x0a\x03abc\x12",        # a truncated subscription
    bytes(range(256)) * 4,
]


def test_malformed_gossip_rpcs_end_the_stream_not_the_node(
        localnet: Callable[..., LocalNet]) -> None:
    net = localnet(2)
    net.up()
    net.wait_until("the nodes are connected", net.fully_connected, timeout=30)
    target = net.nodes[0]
    rogue = GossipPeer("localnet")

    async def attack() -> None:
        async with rogue.running(target.join_addr):
            for _ in range(3):
                for payload in MALFORMED_RPCS:
                    with trio.move_on_after(5):
                        await rogue.send_raw_rpc(target.peer_id, payload)
                    await trio.sleep(0.1)
            await trio.sleep(1)

    trio.run(attack)
    assert target.alive(), target.tail()
    net.wait_until("the node still has its honest peer",
                   lambda: target.peer_ids() >= {net.nodes[1].peer_id}, timeout=15)
    assert "gossip stream from a peer failed" in target.log.read_text()


FUZZ_S = 20.0
"""The suite's share of bench/fuzz_peer.py's minute."""


def test_a_node_under_fuzz_from_two_foreign_peers_stays_up_and_keeps_serving(
        localnet: Callable[..., LocalNet]) -> None:
    """Every protocol, topic and the lane port get garbage, oversized, truncated, slow and
    half-closed input, from one peer that answers the heartbeat and one that never does;
    meanwhile the node answers every generation and keeps its honest peer."""
    net = localnet(2)
    target = start_target(net)
    lane = target.get("/v0/inference")["lanes"]["port"]
    served = {"ok": 0, "failed": 0}
    done = threading.Event()

    def client() -> None:
        while not done.is_set():
            served["ok" if generate_ok(target) else "failed"] += 1

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    counts: list[dict] = []

    async def attack() -> None:
        async with trio.open_nursery() as nursery:
            for i, answers in enumerate((True, False)):
                async def one(answers: bool = answers, i: int = i) -> None:
                    counts.append(await FuzzPeer("localnet", answer_liveness=answers, seed=i)
                                  .run(target.join_addr, target.peer_id, lane, FUZZ_S))
                nursery.start_soon(one)

    try:
        trio.run(attack)
    finally:
        done.set()
        thread.join(60)
    sent = sum(sum(c.values()) for c in counts)
    print(f"{sent} messages sent; generations: {served}")
    assert target.alive(), target.tail()
    assert sent > 100 and served["ok"] > 0 and served["failed"] == 0, (served, target.tail())
    kinds = {k for c in counts for _, k in c}
    assert {"garbage", "oversized", "truncated", "slow", "half-closed"} <= kinds
    net.wait_until("the node still has its honest peer",
                   lambda: target.peer_ids() >= {net.nodes[1].peer_id}, timeout=15)


"""What a foreign peer's bytes can do to a node: end its own stream, never the daemon."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
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

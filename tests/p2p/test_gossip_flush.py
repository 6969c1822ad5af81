"""Gossip.flush: py-libp2p's publish only queues each message for a peer's sending task;
a node about to close its connections waits there until all of them are written."""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio

from kvasird.config import P2PConfig
from kvasird.identity.nodekey import create_node_key
from kvasird.p2p import P2PNode
from tests.support import eventually_async

pytestmark = pytest.mark.slow  # real sockets

FAST = dict(heartbeat_interval_s=0.5, liveness_timeout_s=4.0, peer_exchange_interval_s=0.5,
            mdns=False, listen=("/ip4/127.0.0.1/tcp/0",))
TOPIC = "coverage"
MESSAGES = 16
"""Published in a burst: fewer than py-libp2p queues for a peer (32; it drops the rest)."""
_serial = itertools.count()


def p2p_node(tmp: Path, *bootstrap: str) -> P2PNode:
    return P2PNode(create_node_key(tmp / f"n{next(_serial)}.key"),
                   P2PConfig(**FAST, bootstrap=bootstrap), "flushtest",  # type: ignore[arg-type]
                   sqlite3.connect(":memory:"))


async def test_flush_returns_once_every_queued_message_is_written(tmp_path: Path) -> None:
    stays = p2p_node(tmp_path)
    got: set[bytes] = set()

    async def received(forwarder: Any, msg: Any) -> bool:  # where the market takes records in
        got.add(msg.data)
        return True

    stays.gossip.set_validator(TOPIC, received)
    async with stays.running():
        await stays.gossip.subscribe(TOPIC)
        leaves = p2p_node(tmp_path, stays.addrs()[0])
        async with leaves.running():
            await leaves.gossip.subscribe(TOPIC)
            topic = leaves.gossip.topic(TOPIC)
            mesh = leaves.gossip.router.mesh
            await eventually_async("it would send to the other node at all",
                                   lambda: stays.host.get_id() in mesh.get(topic, ()), timeout=30)
            for i in range(MESSAGES):
                await leaves.gossip.publish(TOPIC, b"goodbye %d" % i)
            assert leaves.gossip.pubsub.unsent() > 0  # queued, not sent
            assert await leaves.gossip.flush()
            assert leaves.gossip.pubsub.unsent() == 0
            await eventually_async(f"the other node received all {MESSAGES} messages",
                                   lambda: len(got) >= MESSAGES, timeout=10)
        assert got == {b"goodbye %d" % i for i in range(MESSAGES)}


async def test_flush_without_peers_returns_at_once(tmp_path: Path) -> None:
    alone = p2p_node(tmp_path)
    async with alone.running():
        await alone.gossip.publish(TOPIC, b"nobody hears this")
        with trio.fail_after(0.5):
            assert await alone.gossip.flush()

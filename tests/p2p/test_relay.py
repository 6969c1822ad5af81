"""Relays with three real P2PNodes in one process: R relays, C is private, A reaches C via R."""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import trio

from kvasird.config import P2PConfig
from kvasird.identity.nodekey import create_node_key
from kvasird.localnet.launcher import free_port
from kvasird.p2p import P2PNode
from tests.support import eventually_async

_serial = itertools.count()
FAST = dict(heartbeat_interval_s=0.5, liveness_timeout_s=4.0, peer_exchange_interval_s=0.5,
            mdns=False, listen=("/ip4/127.0.0.1/tcp/0",))

pytestmark = pytest.mark.slow  # real sockets; failed handshakes wait out their timeouts


@asynccontextmanager
async def nodes(tmp: Path, configs: list[P2PConfig]) -> AsyncIterator[list[P2PNode]]:
    async with AsyncExitStack() as stack:
        out = []
        for config in configs:
            node = P2PNode(create_node_key(tmp / f"n{next(_serial)}.key"), config, "relaytest",
                           sqlite3.connect(":memory:"))
            out.append(await stack.enter_async_context(node.running()))
        yield out


def join(node: P2PNode, **extra: object) -> P2PConfig:
    return P2PConfig(**{**FAST, "bootstrap": (node.addrs()[0],), **extra})  # type: ignore[arg-type]


async def test_private_node_reserves_on_a_relay_and_is_reached_through_it(tmp_path: Path) -> None:
    # The nodes' state is owned by their own tasks, with nothing to wait on: the test polls it.
    async with nodes(tmp_path, [P2PConfig(**FAST)]) as (relay,):
        dead = f"/ip4/127.0.0.1/tcp/{free_port()}"
        configs = [join(relay), join(relay, announce=(dead,), peer_exchange=False, dht=False,
                                     relay_reservations=1)]
        async with nodes(tmp_path, configs) as (a, c):
            await eventually_async("C holds a reservation on R",
                                   lambda: list(c.relays.reservations) == [relay.peer_id],
                                   timeout=40, every=0.1)
            assert c.reachability.current.verdict == "private"
            assert relay.relays.serving
            start = trio.current_time()
            await eventually_async("A heartbeats with C",
                                   lambda: (a.peers.get(c.peer_id) or _NONE).rtt_ms is not None,
                                   timeout=40, every=0.1)
            took = trio.current_time() - start
            print(f"A reached C through R {took:.1f} s after the reservation")
            seen = a.peers.get(c.peer_id)
            assert seen is not None and any("/p2p-circuit/" in x for x in seen.addrs)
            # A node that learns C only from a record (its addresses) connects on demand.
            async with nodes(tmp_path, [join(relay, peer_exchange=False, dht=False)]) as (d,):
                await eventually_async("D is connected to R", lambda: relay.peer_id in d.peers,
                                       timeout=20, every=0.1)
                assert not d.dialer.connected(c.peer_id)
                assert await d.connect(c.peer_id, c.addrs())
                await eventually_async(
                    "D heartbeats with C",
                    lambda: (d.peers.get(c.peer_id) or _NONE).rtt_ms is not None,
                    timeout=20, every=0.1)


class _NONE:
    rtt_ms = None

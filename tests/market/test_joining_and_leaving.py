"""A node joining and leaving a market: real P2PNodes in one process, each with its market.

A joining node that names its model by id fetches the coverage map before it knows the
model (the manifest comes from the peers that map names): the records it fetched then are
mapped once it knows the model. They were dropped, and the ones fetched again before its
first decision were refused as already seen, so its first round could take units whose
holders it did not know of ("no holder left").

A node that leaves says goodbye: its peers drop it from their maps when the goodbye
arrives, long before its record's TTL would have, and no round of its own market
publishes it online again.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from kvasird.config import MarketConfig, P2PConfig
from kvasird.identity.nodekey import create_node_key
from kvasird.market.model import MarketModel
from kvasird.market.records import Capabilities
from kvasird.market.service import GOODBYE_TIMEOUT_S, MarketService
from kvasird.model.manifest import HEAD, Unit
from kvasird.p2p import P2PNode
from tests.support import eventually_async

pytestmark = pytest.mark.slow  # real sockets
MB = 1 << 20
MODEL = MarketModel.uniform("ab" * 32, 4, 0, layer_bytes=MB, expert_bytes=0, head_bytes=MB)
MARKET = MarketConfig(memory_budget_mb=8, heartbeat_s=0.5, rebalance_s=1.0, enroll_delay_s=0.0)
"""Room for the whole model on each node; records live MIN_TTL_S."""
FAST = dict(heartbeat_interval_s=0.5, liveness_timeout_s=4.0, peer_exchange_interval_s=0.5,
            mdns=False, listen=("/ip4/127.0.0.1/tcp/0",))
_serial = itertools.count()


def p2p_node(tmp: Path, *bootstrap: str) -> P2PNode:
    return P2PNode(create_node_key(tmp / f"n{next(_serial)}.key"),
                   P2PConfig(**FAST, bootstrap=bootstrap), "markettest",  # type: ignore[arg-type]
                   sqlite3.connect(":memory:"))


@asynccontextmanager
async def market_node(tmp: Path, *bootstrap: str) -> AsyncIterator[MarketService]:
    """A P2PNode with its market running (the model known); on exit the market stops,
    then the node."""
    p2p = p2p_node(tmp, *bootstrap)
    async with p2p.running(), trio.open_nursery() as nursery:
        market = MarketService(p2p, MARKET, MODEL, Capabilities(), seed=next(_serial))
        await nursery.start(market.run)
        yield market
        nursery.cancel_scope.cancel()


class Shards:
    """A shard service that knows no model until the test lets it resolve one."""

    def __init__(self) -> None:
        self.resolvable = trio.Event()
        self.store = SimpleNamespace(manifest=self._no_manifest, name_of=lambda model: None,
                                     name_claim=lambda model: ("", False),
                                     adopt_name=lambda model, name: None)

    async def resolve(self, text: str, announcers: Any, named: Any = None) -> Any:
        await self.resolvable.wait()
        sizes = {**{Unit("layer", i): MB for i in range(MODEL.n_layer)}, HEAD: MB}
        return SimpleNamespace(model_id=MODEL.model_id, n_layer=MODEL.n_layer, n_expert=0,
                               unit_sizes=sizes)

    def has_all(self, model_id: str) -> bool:
        return False

    async def open_stream(self, peer: str) -> Any:
        raise AssertionError("a node that holds nothing checks no claims")

    @staticmethod
    def _no_manifest(model_id: str) -> Any:
        raise KeyError(model_id)


async def test_records_fetched_before_the_model_was_known_are_mapped_once_it_is(
        tmp_path: Path) -> None:
    async with market_node(tmp_path) as holder:
        await eventually_async("the holder maps itself", lambda: holder.map is not None
                               and bool(holder.map.entries.get(holder.p2p.peer_id)), timeout=60)
        shards = Shards()
        joiner = MarketService(p2p_node(tmp_path, holder.p2p.addrs()[0]),
                               MarketConfig(model=MODEL.model_id, memory_budget_mb=0),
                               None, Capabilities(), shards=shards)  # type: ignore[arg-type]
        async with joiner.p2p.running(), trio.open_nursery() as nursery:
            await nursery.start(joiner.run)
            await eventually_async("the joiner has the holder's record", lambda:
                                   holder.p2p.peer_id in joiner.announcers.get(MODEL.model_id, ()),
                                   timeout=30)
            assert joiner.map is None  # the record came; the model is not known yet
            shards.resolvable.set()
            await eventually_async("the joiner has a map", lambda: joiner.map is not None,
                                   timeout=10)
            entry = joiner.map.entries.get(holder.p2p.peer_id)
            assert entry is not None and entry.record.holdings
            assert holder.p2p.peer_id in joiner.signed  # handed on to nodes that sync
            nursery.cancel_scope.cancel()


async def test_a_node_that_leaves_is_out_of_its_peers_map_before_its_connections_close(
        tmp_path: Path) -> None:
    """leave() returns once each connected peer has applied the goodbye: the connections
    may close at once (py-libp2p's muxer then drops what a peer had not read yet)."""
    async with market_node(tmp_path) as stays:
        async with market_node(tmp_path, stays.p2p.addrs()[0]) as leaves:
            def mapped() -> bool:
                entry = stays.map.entries.get(leaves.p2p.peer_id) if stays.map else None
                return entry is not None and bool(entry.record.holdings)

            await eventually_async("the node that stays maps the one that leaves", mapped,
                                   timeout=60)
            assert leaves.p2p.peer_id in stays.signed
            with trio.fail_after(GOODBYE_TIMEOUT_S + 1):
                await leaves.leave()
            assert leaves.state == "offline" and not leaves.held
            assert leaves.p2p.peer_id not in stays.map.entries
            assert leaves.p2p.peer_id not in stays.signed  # nor handed to nodes that sync
            assert leaves.left.is_set()  # its loops ended: no round publishes it online again


async def test_a_market_that_never_started_leaves_at_once() -> None:
    p2p = SimpleNamespace(peer_id="me")  # it neither listens nor dials
    market = MarketService(p2p, MARKET, None, Capabilities())  # type: ignore[arg-type]
    with trio.fail_after(0.1):
        await market.leave()

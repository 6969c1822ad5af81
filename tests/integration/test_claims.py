"""Claims checked before trust, across real daemons: a peer whose signed, well-formed
record claims the head and every layer, and that answers the challenges of that claim
with bytes it does not have, is caught by every node, leaves every map, and is never
routed to."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from gossip_peer import GossipPeer  # type: ignore[import-not-found]
from test_swarm import PROMPTS, generate, start  # type: ignore[import-not-found]

from kvasird import PROTOCOL_VERSION
from kvasird.localnet import LocalNet
from kvasird.market.model import MarketModel
from kvasird.market.records import CoverageRecord, Holding
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest
from kvasird.wire import pack

pytestmark = pytest.mark.slow

CAUGHT_S = 60.0


def test_a_peer_lying_about_its_holdings_leaves_every_map_and_is_never_routed_to(
        localnet: Callable[..., LocalNet]) -> None:
    model: Path = bundled_path()
    market = MarketModel.from_manifest(Manifest.from_gguf(model))
    # The gateway embeds and samples; one node holds every layer. The liar claims all of it
    # in one hop: on a route of fewer hops, the one a gateway prefers.
    net = start(localnet, model, [["head"], [f"layers:0-{market.n_layer}"]])
    gateway = net.nodes[0]
    undisturbed = [generate(gateway, p) for p in PROMPTS]
    rogue = GossipPeer("localnet")
    seen: dict[str, dict] = {}

    def claim(seq: int) -> bytes:
        record = CoverageRecord(
            rogue.peer_id, seq, time.time(), 10.0, "online", PROTOCOL_VERSION, "evil",
            tuple(rogue.advertised),
            market.model_id, 2**40,
            (Holding("H", 0, 0, 1, "online"), Holding("L", 0, 0, market.n_layer, "online")),
            boot="rogue")
        return pack(record.to_wire())

    def caught() -> bool:
        views = {n.peer_id: n.get("/v0/coverage") for n in net.nodes}
        seen.update(views)
        return all(rogue.peer_id in v["proofs"]["liars"] and rogue.peer_id not in v["holders"]
                   for v in views.values())

    async def attack() -> None:
        async with rogue.running(gateway.join_addr, lie_about_shards=True):
            deadline = trio.current_time() + CAUGHT_S
            seq = 1
            while not await trio.to_thread.run_sync(caught):
                assert trio.current_time() < deadline, f"not caught by every node: {seen}"
                await rogue.publish("coverage", claim(seq))
                seq += 1
                await trio.sleep(0.5)
            # caught, it keeps claiming: its records are dropped, the gateway serves exactly
            for _ in range(3):
                await rogue.publish("coverage", claim(seq))
                seq += 1
            during = await trio.to_thread.run_sync(
                lambda: [generate(gateway, p) for p in PROMPTS])
            assert during == undisturbed
            assert rogue.shard_requests, "nobody challenged the claim"

    trio.run(attack)
    for node in net.nodes:
        view = node.get("/v0/coverage")
        assert rogue.peer_id not in view["holders"]
        assert "wrong bytes" in view["proofs"]["liars"][rogue.peer_id]
        inference = node.get("/v0/inference")
        assert rogue.peer_id not in inference["unfit"], "it was routed to and failed"
    assert "peer lied about what it holds" in gateway.log.read_text()

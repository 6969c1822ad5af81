"""MarketService's enrollment round against a real map: what the engine is left serving."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvasird.config import MarketConfig
from kvasird.market.enroll import _rank
from kvasird.market.model import MarketModel
from kvasird.market.pacing import DEFAULT_RATE, TAKE_S, take_bytes
from kvasird.market.records import Capabilities, CoverageRecord, compress
from kvasird.market.service import MarketService
from kvasird.model.manifest import HEAD, Unit
from kvasird.model.transfer import TransferReport

MB = 1 << 20
L = [Unit("layer", i) for i in range(4)]


class Gossip:
    def __init__(self) -> None:
        self.published = 0

    async def publish(self, topic: str, data: bytes) -> bool:
        self.published += 1
        return True


def p2p(peer: str) -> SimpleNamespace:
    """What the service reads of its P2PNode when it neither listens nor dials."""
    return SimpleNamespace(peer_id=peer, config_path="kvasird.toml", gossip=Gossip(),
                           addrs=lambda: [], reachability=SimpleNamespace(
                               current=SimpleNamespace(verdict="unknown")))


def surplus_holder(other: str) -> str:
    """A peer id that ranks after ``other`` for layers 0 and 1: the one that gives them up."""
    return next(me for me in (f"me{i}" for i in range(1000))
                if all(_rank(u, me) > _rank(u, other) for u in L[:2]))


async def test_an_add_that_fails_after_a_drop_leaves_the_engine_serving_what_is_held() -> None:
    """Layers 0-1 are ours and the other peer's too; layer 3 is nobody's: the round drops
    one of ours to take layer 3, whose load fails. The engine must then serve what the
    record says, not the layers it held before the round."""
    model = MarketModel.uniform("ab" * 32, 4, 0, layer_bytes=MB, expert_bytes=0, head_bytes=MB)
    me = surplus_holder("other")
    engine: dict[str, set[Unit]] = {"serving": set()}

    async def loader(units: list[Unit]) -> None:
        if set(units) & {L[3]}:
            raise RuntimeError("out of memory")  # the add's own load fails
        engine["serving"] = {u for u, s in market.held.items() if s != "draining"}

    market = MarketService(p2p(me), MarketConfig(memory_budget_mb=2, target_replicas=1),  # type: ignore[arg-type]
                           model, Capabilities(), loader=loader, seed=0)
    market.held = {L[0]: "online", L[1]: "online"}
    await loader([])
    now = time.time()
    for peer, units in (("other", [HEAD, L[0], L[1], L[2]]), (me, L[:2])):
        market.map.apply(CoverageRecord(peer, 1, now, 60, "online", 1, "", (), model.model_id,
                                        10 * MB, compress({u: "online" for u in units})), now)
    await market.rebalance()
    assert L[3] not in market.held and len(market.held) == 1  # dropped one, gave 3 up
    assert engine["serving"] == set(market.held)


class Shards:
    """A shard source whose downloads take a set time: what ``fetch`` reports, and no more."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.store = SimpleNamespace(held_units=lambda model_id: [], name_of=lambda model_id: None,
                                     name_claim=lambda model_id: ("", False))

    async def fetch(self, model_id: str, units: tuple[Unit, ...], holders: list[str]
                    ) -> TransferReport:
        size = len(units) * MB
        return TransferReport(model_id, tuple(units), size, 0, size, 0, (), self.seconds)

    def has_all(self, model_id: str) -> bool:
        return False

    def prune(self, model_id: str, keep: set[Unit], budget: int) -> int:
        return 0

    async def open_stream(self, peer: str) -> None:
        raise AssertionError("no proofs are asked in this test")


async def test_the_next_take_is_sized_by_the_rate_of_the_last_download() -> None:
    """The node downloads its first round (5 MiB: everything) in 2 s: its rate is then
    2.5 MiB/s, and its next take is 30 s of that instead of the default."""
    model = MarketModel.uniform("ab" * 32, 4, 0, layer_bytes=MB, expert_bytes=0, head_bytes=MB)
    config = MarketConfig(memory_budget_mb=1000, target_replicas=1)
    market = MarketService(p2p("me"), config, model, Capabilities(), seed=0,  # type: ignore[arg-type]
                           shards=Shards(2.0))  # type: ignore[arg-type]
    assert market.bandwidth.rate == DEFAULT_RATE
    await market.rebalance()
    assert len(market.held) == 5
    assert market.bandwidth.rate == 5 * MB / 2.0
    assert take_bytes(model, market.budget, market.bandwidth.rate) == TAKE_S * 5 * MB / 2.0

"""One spare replica of every unit when the market has room: the market's budget from the
records a map holds, the threshold, enrollment against the spare targets, and what is
reported against the real ones."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from kvasird.config import MarketConfig
from kvasird.market.coverage import CoverageMap
from kvasird.market.demand import SPARE_ROOM, Demand, wanted_bytes, with_spare
from kvasird.market.enroll import _rank, decide
from kvasird.market.model import MarketModel
from kvasird.market.publish import PRESENCE_K, market_budget
from kvasird.market.records import Capabilities, CoverageRecord, compress
from kvasird.market.service import MarketService
from kvasird.model.manifest import HEAD, Unit

MODEL_ID = "ab" * 32
MB = 1 << 20


def record(peer: str, budget: int, held: dict[Unit, str] | None = None, seq: int = 1,
           now: float = 0.0) -> CoverageRecord:
    held = held or {}
    return CoverageRecord(peer, seq, now, 60, "online", 1, "", (), MODEL_ID if held else "",
                          budget, compress(held))


def test_wanted_bytes_count_every_replica_the_targets_ask_for(model: MarketModel) -> None:
    targets = Demand(model).targets(2)
    assert wanted_bytes(model, targets) == 2 * model.total_bytes
    targets.expert[0, 0] = 5  # a hot expert: 3 more of 10 B
    assert wanted_bytes(model, targets) == 2 * model.total_bytes + 30


def test_a_spare_replica_is_wanted_only_when_the_market_has_room_for_it(
        model: MarketModel) -> None:
    targets = Demand(model).targets(2)
    room = wanted_bytes(model, targets) + SPARE_ROOM * model.total_bytes
    assert with_spare(targets, model, room - 1) is targets
    spare = with_spare(targets, model, room)
    assert spare.head == 3 and (spare.layer == 3).all() and (spare.expert == 3).all()
    assert (targets.layer == 2).all()  # the targets themselves are left alone


def test_the_market_budget_extrapolates_the_silent_nodes_from_the_ones_that_publish() -> None:
    holders = [record(f"h{i}", 100 * (i + 1), {HEAD: "online"}) for i in range(3)]  # 600 B
    silent = [record(f"s{i}", 10) for i in range(PRESENCE_K)]
    # a map holding every record knows every budget
    assert market_budget(holders + silent[:20], 23) == 600 + 20 * 10
    # a large market: only PRESENCE_K of the 1,000 silent nodes publish
    assert market_budget(holders + silent, 1003) == 600 + 1000 * 10
    assert market_budget(holders, 3) == 600


def surplus_holder(unit: Unit, others: list[str]) -> str:
    """A peer id ranking after ``others`` for ``unit``: a designated surplus holder of it."""
    return next(me for me in (f"me{i}" for i in range(1000))
                if all(_rank(unit, me) > _rank(unit, o) for o in others))


def test_the_spare_replica_is_kept_not_given_up_as_surplus(model: MarketModel) -> None:
    """We hold layer 0 with two others (3 replicas), and layer 1 has one holder. Against
    target 2 our layer 0 is surplus and we swap it for layer 1; against the spare target
    3 it is wanted, and we keep it."""
    l0, l1 = Unit("layer", 0), Unit("layer", 1)
    me = surplus_holder(l0, ["a", "b"])
    cmap = CoverageMap(model)
    everything = {u: "online" for u in model.units() if u != l1}
    holdings = {"a": everything, "b": {**everything, l1: "online"}, me: {l0: "online"}}
    for peer, held in holdings.items():
        cmap.apply(record(peer, 10**6, held), 0.0)
    targets = Demand(model).targets(2)
    for wanted, drops in ((targets, (l0,)), (with_spare(targets, model, 10**6), ())):
        plan = decide(model, cmap.active, wanted, me, 100, {l0}, set(), cmap.holders,
                      np.random.default_rng(0), peers=1)  # a swap is always allowed
        assert plan.drop == drops


class Gossip:
    """A gossip service with no peers: publishing reaches no one, no one has a score."""

    router = SimpleNamespace(peer_protocol={}, scorer=None)

    async def publish(self, topic: str, data: bytes) -> bool:
        return True

    def topic(self, name: str) -> str:
        return name


def p2p(peer: str) -> SimpleNamespace:
    """What the service reads of its P2PNode when it neither listens nor dials."""
    return SimpleNamespace(peer_id=peer, config_path="kvasird.toml", gossip=Gossip(),
                           addrs=lambda: [], reachability=SimpleNamespace(
                               current=SimpleNamespace(verdict="unknown")))


async def test_a_node_enrolls_for_the_spare_replica_while_its_view_reports_the_real_target(
        ) -> None:
    """Two peers hold everything (target 2 met). With room in the market a third node takes
    the spare replica, and its coverage view still says covered at target 2; without
    room it takes nothing."""
    model = MarketModel.uniform(MODEL_ID, 4, 0, layer_bytes=MB, expert_bytes=0, head_bytes=MB)
    everything = {u: "online" for u in model.units()}
    for peer_budget, takes in ((100 * MB, set(model.units())), (5 * MB, set())):
        config = MarketConfig(memory_budget_mb=10, target_replicas=2)
        market = MarketService(p2p("me"), config, model, Capabilities(), seed=0)  # type: ignore[arg-type]
        now = time.time()
        for peer in ("a", "b"):
            market.map.apply(record(peer, peer_budget, everything, now=now), now)
        await market.rebalance()
        assert set(market.held) == takes
        view = market.coverage()
        assert view["fully_covered"]
        assert {s["target"] for s in view["segments"]} == {2}

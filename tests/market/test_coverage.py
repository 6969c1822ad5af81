from __future__ import annotations

import pytest

from kvasird.errors import WireError
from kvasird.market.coverage import CoverageMap
from kvasird.market.model import MarketModel
from kvasird.market.records import CoverageRecord, Holding
from kvasird.model.manifest import HEAD, Unit

MODEL_ID = "ab" * 32


def rec(peer: str, seq: int, holdings: tuple[Holding, ...], state: str = "online",
        ttl: float = 10.0, budget: int = 10_000) -> CoverageRecord:
    return CoverageRecord(peer, seq, 0.0, ttl, state, 1, "0.1.0", (), MODEL_ID, budget, holdings)


def test_newer_record_replaces_older_and_out_of_order_ones_are_ignored(model: MarketModel) -> None:
    m = CoverageMap(model)
    assert m.apply(rec("a", 2, (Holding("L", 0, 0, 2, "online"),)), now=0)
    assert not m.apply(rec("a", 1, (Holding("L", 2, 2, 4, "online"),)), now=0)  # late, older
    assert not m.apply(rec("a", 2, (Holding("L", 0, 0, 2, "online"),)), now=0)  # duplicate
    assert list(m.active.layer) == [1, 1, 0, 0]
    assert m.apply(rec("a", 3, (Holding("L", 2, 2, 4, "online"),)), now=0)
    assert list(m.active.layer) == [0, 0, 1, 1]


def test_joining_counts_for_scarcity_but_not_for_routing(model: MarketModel) -> None:
    m = CoverageMap(model)
    m.apply(rec("a", 1, (Holding("E", 1, 0, 4, "joining"), Holding("H", 0, 0, 1, "online"))), 0)
    assert list(m.active.expert[1]) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert m.online.expert.sum() == 0 and m.online.head == 1
    assert m.holders(Unit("expert", 1, 2)) == ["a"]
    assert m.holders(HEAD) == ["a"]


def test_records_expire_after_their_ttl_and_offline_removes_at_once(model: MarketModel) -> None:
    m = CoverageMap(model)
    m.apply(rec("a", 1, (Holding("H", 0, 0, 1, "online"),), ttl=10), now=100)
    m.apply(rec("b", 1, (Holding("H", 0, 0, 1, "online"),), ttl=30), now=100)
    assert m.expire(105) == [] and m.active.head == 2
    assert m.expire(111) == ["a"] and m.active.head == 1
    m.apply(rec("b", 2, (), state="offline"), now=112)
    assert m.active.head == 0 and m.entries == {}


@pytest.mark.parametrize("holding", [Holding("L", 3, 3, 5, "online"),
                                     Holding("E", 4, 0, 1, "online"),
                                     Holding("E", 0, 6, 9, "online")])
def test_holdings_outside_the_model_are_refused(model: MarketModel, holding: Holding) -> None:
    with pytest.raises(WireError, match="outside model"):
        CoverageMap(model).check(rec("a", 1, (holding,)))


def test_holdings_beyond_the_claimed_budget_are_refused(model: MarketModel) -> None:
    everything = (Holding("L", 0, 0, 4, "online"), Holding("H", 0, 0, 1, "online"))
    with pytest.raises(WireError, match="budget"):
        CoverageMap(model).check(rec("a", 1, everything, budget=100))

"""Unfit verdicts from gossip: validated records, and a quorum before anyone is avoided."""

from __future__ import annotations

import pytest

from kvasird.errors import WireError
from kvasird.inference.client.routing import Fitness
from kvasird.inference.verdicts import Verdict, Verdicts
from tests.support import Clock


def verdicts(quorum: int, clock: Clock | None = None) -> tuple[Verdicts, Fitness]:
    fitness = Fitness(unfit_s=60)
    return Verdicts(None, "me", fitness, quorum, window_s=60,  # type: ignore[arg-type]
                    clock=clock or Clock()), fitness


async def test_one_accuser_is_not_enough_when_the_quorum_is_two() -> None:
    v, fitness = verdicts(2)
    v.apply(Verdict("a", 1, 0.0, "liar", "spot check failed on layer 3"))
    v.apply(Verdict("a", 2, 0.0, "liar", "again"))
    assert fitness.fit("liar")
    v.apply(Verdict("b", 1, 0.0, "liar", "spot check failed on layer 1"))
    assert not fitness.fit("liar")


async def test_an_accusation_older_than_the_window_does_not_count_toward_the_quorum() -> None:
    clock = Clock()
    v, fitness = verdicts(2, clock)
    v.apply(Verdict("a", 1, 0.0, "liar", "spot check failed on layer 3"))
    clock.now += 61
    v.apply(Verdict("b", 1, 0.0, "liar", "spot check failed on layer 1"))
    assert fitness.fit("liar") and set(v.accusers["liar"]) == {"b"}
    clock.now += 59
    v.apply(Verdict("a", 2, 0.0, "liar", "again"))
    assert not fitness.fit("liar")


async def test_nobody_can_get_us_to_avoid_ourselves() -> None:
    v, fitness = verdicts(1)
    v.apply(Verdict("a", 1, 0.0, "me", "lies"))
    assert fitness.fit("me")


@pytest.mark.parametrize("bad", [None, {"v": 2}, {"v": 1, "peer": "a", "seq": -1, "ts": 1.0,
                                                   "accused": "x", "reason": ""},
                                 {"v": 1, "peer": "a", "seq": 1, "ts": 1.0, "accused": "x",
                                  "reason": "r" * 1000}])
def test_malformed_verdicts_are_refused(bad: object) -> None:
    with pytest.raises(WireError):
        Verdict.from_wire(bad)


def test_a_verdict_round_trips() -> None:
    v = Verdict("a", 7, 123.5, "x", "why")
    assert Verdict.from_wire(v.to_wire()) == v

"""Claims checked before trust: real stores, the real shard server, in-memory streams."""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio

from kvasird.errors import WireError
from kvasird.inference.client.routing import PeerHoldings
from kvasird.market.proofs import ClaimChecker, pick
from kvasird.market.records import CoverageRecord, Holding, compress
from kvasird.model.manifest import HEAD, Manifest, Unit
from kvasird.model.store import ShardStore
from kvasird.model.transfer import _answer, proof_digest

from .conftest import Swarm
from .test_transfer import FlippingSource


def record(peer: str, manifest: Manifest, units: list[Unit], *, boot: str = "b1",
           seq: int = 1, has_all: bool = False) -> CoverageRecord:
    return CoverageRecord(peer, seq, time.time(), 10.0, "online", 1, "t", (), manifest.model_id,
                          2**40, compress({u: "online" for u in units}), has_all=has_all,
                          boot=boot)


class Checker:
    """A ClaimChecker over a swarm, with the records it would read from the map."""

    def __init__(self, swarm: Swarm, store: ShardStore, seed: int = 0) -> None:
        self.records: dict[str, CoverageRecord] = {}
        self.liars: list[tuple[str, str]] = []
        self.c = ClaimChecker("me", store, swarm.open_stream, self.records.get,
                              lambda p, why: self.liars.append((p, why)),
                              np.random.default_rng(seed), timeout_s=5)

    async def check(self, r: CoverageRecord, manifest: Manifest) -> str:
        self.records[r.peer] = r
        self.c.note(r, manifest)
        return await self.c.check(r.peer, manifest)


LAYERS = [Unit("layer", i) for i in range(3)]


async def test_an_honest_holder_is_proven_by_proof_where_we_hold_and_by_read_where_not(
        swarm, source_store, store_factory, moe_manifest):
    swarm.add("honest", source_store)
    holding_verifier = Checker(swarm, source_store)  # holds every piece itself
    bare_verifier = Checker(swarm, store_factory("bare"))
    r = record("honest", moe_manifest, [HEAD, *LAYERS])
    assert await holding_verifier.check(r, moe_manifest) == "proven"
    assert await bare_verifier.check(r, moe_manifest) == "proven"
    assert holding_verifier.c.proven(r) == {HEAD, *LAYERS}
    assert holding_verifier.c.asked["prove"] == 2 and holding_verifier.c.asked["read"] == 0
    assert bare_verifier.c.asked["read"] == 2 and bare_verifier.c.asked["prove"] == 0
    assert 0 < bare_verifier.c.asked["read_bytes"] <= 2 * (4 << 20)
    assert holding_verifier.liars == bare_verifier.liars == []
    # a restart is a new claim: proven again before it counts
    assert holding_verifier.c.proven(record("honest", moe_manifest, LAYERS, boot="b2")) == set()


async def test_wrong_bytes_make_a_liar_at_once_on_either_kind_of_question(
        swarm, source_store, store_factory, moe_manifest):
    swarm.add("flipper", FlippingSource(source_store))
    for verifier in (Checker(swarm, source_store), Checker(swarm, store_factory("bare"))):
        r = record("flipper", moe_manifest, LAYERS)
        assert await verifier.check(r, moe_manifest) == "liar"
        assert [p for p, _ in verifier.liars] == ["flipper"]
        assert "wrong bytes" in verifier.liars[0][1]
        assert verifier.c.banned("flipper") and verifier.c.proven(r) == set()
        verifier.c.note(record("flipper", moe_manifest, LAYERS, boot="b9", seq=2), moe_manifest)
        assert verifier.c.banned("flipper")  # a restart does not end the ban
        assert "flipper" not in verifier.c.view()["unproven"]


async def test_claiming_what_it_lacks_is_doubt_once_and_a_lie_when_its_record_still_claims_it(
        swarm, source_store, store_factory, moe_manifest):
    swarm.add("empty", store_factory("empty"))  # has the manifest of nothing: holds no piece
    verifier = Checker(swarm, source_store)
    r = record("empty", moe_manifest, [HEAD, *LAYERS], has_all=True)
    assert await verifier.check(r, moe_manifest) == "doubt"
    assert verifier.liars == []
    assert await verifier.check(r, moe_manifest) == "liar"
    assert verifier.liars[0][0] == "empty"


async def test_a_holder_that_dropped_what_it_was_asked_for_is_not_a_liar(
        swarm, source_store, store_factory, moe_manifest):
    swarm.add("dropper", store_factory("dropped"))
    verifier = Checker(swarm, source_store)
    assert await verifier.check(record("dropper", moe_manifest, LAYERS), moe_manifest) == "doubt"
    # its next record no longer claims those layers: the race of a drop, not a lie
    later = record("dropper", moe_manifest, [HEAD], seq=2)
    verifier.records["dropper"] = later
    assert await verifier.c.check("dropper", moe_manifest) in ("doubt", "nothing")
    assert verifier.liars == []


async def test_a_holder_that_does_not_answer_is_not_proven_and_is_asked_again_later(
        swarm, source_store, moe_manifest):
    swarm.add("gone", source_store)
    swarm.dead.add("gone")
    verifier = Checker(swarm, source_store)
    r = record("gone", moe_manifest, LAYERS)
    assert await verifier.check(r, moe_manifest) == "unanswered"
    assert verifier.c.proven(r) == set() and verifier.liars == []
    assert verifier.c.claims["gone"].retry_at > trio.current_time()
    swarm.dead.discard("gone")
    assert await verifier.c.check("gone", moe_manifest) == "proven"


def test_questions_are_spread_over_the_claimed_pieces(moe_manifest):
    seen = set()
    for seed in range(40):
        for q in pick(moe_manifest, LAYERS, lambda p: True, np.random.default_rng(seed)):
            assert q.piece.unit in LAYERS
            assert all(q.offset <= o and o + n <= q.offset + q.length for o, n in q.ranges)
            assert len(q.ranges) == 4
            seen.add(q.piece.tensor)
    assert len(seen) > 10  # not always the same few tensors
    assert pick(moe_manifest, [], lambda p: True, np.random.default_rng(0)) == []


def test_the_server_answers_a_proof_with_the_digest_and_refuses_a_bad_nonce(
        source_store, moe_manifest):
    piece = moe_manifest.pieces([Unit("layer", 1)])[0]
    ranges = [[piece.tensor, piece.expert, 0, 16], [piece.tensor, piece.expert, 5, 7]]
    nonce = b"n" * 32
    header, body = _answer(source_store, {"op": "prove", "model": moe_manifest.model_id,
                                          "nonce": nonce, "ranges": ranges})
    data = source_store.read_piece(piece)
    assert header == {"ok": True, "len": 32}
    assert body == [proof_digest(nonce, [data[0:16], data[5:12]])]
    for bad in (b"", b"x" * 8, "text", b"x" * 65):
        with pytest.raises(WireError, match="nonce"):
            _answer(source_store, {"op": "prove", "model": moe_manifest.model_id,
                                   "nonce": bad, "ranges": ranges})


def test_routing_uses_only_the_proven_units_of_a_record(moe_manifest):
    r = record("p", moe_manifest, [HEAD, *LAYERS])
    assert PeerHoldings.of_record(r).windows == ((0, 3),)
    some = PeerHoldings.of_record(r, {Unit("layer", 0), Unit("layer", 2)})
    assert some.windows == ((0, 1), (2, 3)) and not some.head
    assert PeerHoldings.of_record(r, set()) == PeerHoldings("p", False, (), ())
    assert Holding("H", 0, 0, 1, "online") in r.holdings


async def test_a_restart_during_a_check_leaves_the_new_claim_to_be_checked(
        swarm, source_store, moe_manifest):
    """The answer to the old boot's question arrives after the peer restarted: it proves
    nothing of the new boot, whose claim stays due."""
    swarm.add("p", source_store)
    verifier = Checker(swarm, source_store)
    old = record("p", moe_manifest, LAYERS, boot="b1")
    verifier.records["p"] = old
    verifier.c.note(old, moe_manifest)
    real_ask = verifier.c._ask

    async def ask_then_restart(*args):
        new = record("p", moe_manifest, LAYERS, boot="b2", seq=2)
        verifier.records["p"] = new
        verifier.c.note(new, moe_manifest)
        return await real_ask(*args)

    verifier.c._ask = ask_then_restart
    assert await verifier.c.check("p", moe_manifest) == "nothing"
    assert verifier.c.proven(verifier.records["p"]) == set()
    assert "p" in verifier.c.view()["unproven"]
    verifier.c._ask = real_ask
    assert await verifier.c.check("p", moe_manifest) == "proven"

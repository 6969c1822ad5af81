"""Spot checks in process: with the default settings, a stage and an expert worker that
return perturbed outputs are caught within the sessions docs/verification.md predicts,
are paid nothing for those sessions, are avoided, and leave evidence on the checking
node; checked every time, 1,000 honest sessions (and worker calls) flag nobody; a head
that answers a token it did not draw is caught, and a lying checker is caught in place of
the peer it checked; a stage that computes the relayed first chunk honestly and lies on
the forwarded decode steps is caught from the rows it must show of a drawn step, on a
route of any peers; a hop whose commitment contradicts what it sent is paid nothing.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvasird.compute.sampling import SamplingParams
from kvasird.config import InferenceConfig
from kvasird.inference.api import GenerationRequest, ModelInfo, Sampling, TokenEvent
from kvasird.inference.client.dispatch import ExpertDispatcher
from kvasird.inference.client.routing import Fitness, Hop, Latency, PeerHoldings
from kvasird.inference.client.spotcheck import (
    SpotChecks,
    cover,
    divergence,
    head_agrees,
    within,
)
from kvasird.inference.client.swarm import SwarmGenerator
from kvasird.inference.protocol import tensors
from kvasird.inference.protocol.stage import Open
from kvasird.inference.server.engine import Holdings, Served
from kvasird.inference.server.stage import StageServer
from kvasird.inference.stepcontext import TALLY, Tally

from .conftest import N_EXPERT, N_LAYER, PROMPT
from .fakenet import FakeNet, Handle, hung, lying, no_experts
from .test_serving import STAGE

DEFAULTS = InferenceConfig()


def test_the_predicted_bounds_are_the_pages_numbers() -> None:
    """docs/verification.md's table, at the default rates."""
    assert DEFAULTS.spot_check_stages == 0.1 and DEFAULTS.spot_check == 0.05
    assert [within(0.1, c) for c in (0.95, 0.99, 0.9999)] == [29, 44, 88]
    assert [within(0.05, c) for c in (0.95, 0.99, 0.9999)] == [59, 90, 180]
    assert within(0.0, 0.95) is None and within(1.0, 0.95) == 1


@pytest.fixture(scope="module")
def replicated(model: Path) -> Iterator[dict[str, Served]]:
    """gw: head + layer 0; b, b2 and b3: layers 1-2 (replicas); c: layer 3 (alone)."""
    parts = {"gw": Holdings(head=True, windows=((0, 1),)), "b": Holdings(windows=((1, 3),)),
             "b2": Holdings(windows=((1, 3),)), "b3": Holdings(windows=((1, 3),)),
             "c": Holdings(windows=((3, 4),))}
    out = {name: Served.build([model], h, threads=1, kv_slots=256, remote=no_experts)
           for name, h in parts.items()}
    yield out
    for s in out.values():
        s.close()


def perturbing(opened: list[str], peer: str):  # noqa: ANN201 - a fakenet Fault
    """A stage that answers steps with its rows scaled and shifted (and notes each session
    opened on it)."""
    def fault(handle: Handle) -> Handle:
        async def lie(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
            if msg.get("op") == "open":
                opened.append(peer)
            reply = await handle(caller, msg)
            if msg.get("op") == "step" and "x" in reply:
                x = tensors.decode(reply["x"], "x", ("f32", "f16"), (None, None))
                return {**reply, "x": tensors.encode(x * 1.5 + 0.01, reply["x"]["dt"])}
            return reply
        return lie
    return fault


def generator(net: FakeNet, spot: SpotChecks, fitness: Fitness,
              config: InferenceConfig = DEFAULTS) -> SwarmGenerator:
    """The gateway's generator over `net` (b is nearer than its replicas)."""
    return SwarmGenerator(net.me, lambda: ModelInfo("m", "test", 256), lambda: N_LAYER,
                          net.holders, net, net.servers[net.me].handle,  # type: ignore[arg-type]
                          Latency(net.me, lambda p: 1.0 if p in ("b", "c") else 5.0),
                          fitness, config, net.inbox, spot=spot)


async def generate(gen: SwarmGenerator, rid: str, n: int = 3,
                   params: SamplingParams = SamplingParams(temperature=0)) -> list[int]:
    net: FakeNet = gen.channels  # type: ignore[assignment]
    req = GenerationRequest("m", tuple(PROMPT), Sampling(params, n), request_id=rid)
    async with net.running() as nursery:
        gen.nursery = nursery
        return [e.token async for e in gen.generate(req) if isinstance(e, TokenEvent)]


async def test_a_stage_returning_perturbed_rows_is_caught_paid_nothing_and_avoided(
        replicated: dict[str, Served], reference: list[int], tmp_path: Path) -> None:
    opened: list[str] = []
    net, fitness = FakeNet(replicated), Fitness(DEFAULTS.unfit_s)
    net.faults["b"] = perturbing(opened, "b")
    spot = SpotChecks(DEFAULTS.spot_check_stages, DEFAULTS.spot_check,
                      DEFAULTS.spot_tolerance, tmp_path / "spotchecks")
    gen = generator(net, spot, fitness)
    bound = within(DEFAULTS.spot_check_stages, 0.9999) or 0
    for i in range(bound):
        tokens = await generate(gen, f"r{i}")
        work = {w.peer: w.units for w in gen.work(f"r{i}")}
        if spot.stages.caught:
            break
        # not drawn, yet not paid: its answers are not the rows it committed to
        assert "b" not in work and spot.decode.unshown == i + 1
    assert spot.stages.caught == 1, f"not caught within {bound} sessions"
    evidence = spot.evidence[0]
    assert evidence.peer == "b" and evidence.unit == "layers 1-2"
    assert evidence.sessions <= bound and evidence.divergence > DEFAULTS.spot_tolerance
    # the caught generation: replayed on a route without b, b paid nothing, the checkers
    # paid for their recomputation like any hop
    assert tokens == reference[:3]
    assert "b" not in work and set(evidence.checkers) <= {"b2", "b3"}
    assert all(work[p] > 0 for p in evidence.checkers)
    # avoided as a liar, and never opened a session on again
    assert fitness.lied("b")
    sessions = len(opened)
    assert await generate(gen, "after") == reference[:3]
    assert len(opened) == sessions
    # the evidence is kept on the checking node: a JSON line and the arrays
    lines = (tmp_path / "spotchecks" / "evidence.jsonl").read_text().splitlines()
    kept = json.loads(lines[0])
    assert kept["peer"] == "b" and kept["verdict"] == "caught"
    arrays = np.load(tmp_path / "spotchecks" / kept["arrays"])
    assert arrays["input"].shape[0] == len(PROMPT)
    assert divergence(arrays["output"], arrays["reference"]) == pytest.approx(kept["divergence"])
    assert spot.status()["evidence"][0]["input_sha256"] == kept["input_sha256"]


async def honestly(gen: SwarmGenerator, sessions: int, n: int, reference: list[int]) -> None:
    """`sessions` generations of `n` tokens, greedy and seeded by turns; the greedy ones
    must be the reference's."""
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=7)
    for i in range(sessions):
        tokens = await generate(gen, f"h{i}", n, seeded if i % 2 else SamplingParams())
        if i % 2 == 0:
            assert tokens == reference[:n]


@pytest.mark.slow
async def test_a_thousand_honest_sessions_checked_every_time_flag_nobody(
        replicated: dict[str, Served], reference: list[int]) -> None:
    """Every hop of every session checked (rate 1), greedy and seeded sampling alike: no
    peer is caught, no check is left undecided, and the stage nobody else holds (c) is
    reported as unchecked, by name."""
    net, fitness = FakeNet(replicated), Fitness(DEFAULTS.unfit_s)
    spot = SpotChecks(1.0, 1.0, DEFAULTS.spot_tolerance)
    gen = generator(net, spot, fitness, InferenceConfig(spot_check_stages=1.0))
    await honestly(gen, 1000, 2, reference)
    assert spot.stages.caught == 0 and spot.stages.unresolved == 0
    assert spot.stages.checked == 1000  # b's, by b2 or b3
    assert spot.stages.worst_pass == 0.0  # one backend, the same chunk: the same bits
    # b's later steps too, from the rows it showed; c has no replica
    assert spot.decode.checked == 1000 and spot.decode.unchecked == 1000
    assert spot.decode.caught == 0 and spot.decode.unresolved == 0 and spot.decode.unshown == 0
    assert spot.status()["unchecked_units"] == {"layer 3": 1000, "layer 3 (decode steps)": 1000}
    assert fitness.snapshot() == {}


@pytest.mark.slow
async def test_a_thousand_honest_sessions_checked_on_their_later_steps_flag_nobody(
        tails: dict[str, Served], reference: list[int]) -> None:
    """A route of the gateway and one peer, every session drawn (rate 1), greedy and seeded
    sampling alike: every later step recomputed from the rows the peer shows gives the
    generation's token."""
    net, fitness = FakeNet(tails), Fitness(DEFAULTS.unfit_s)
    spot = SpotChecks(1.0, 0.0, DEFAULTS.spot_tolerance)
    gen = tail_generator(net, spot, fitness, InferenceConfig(spot_check_stages=1.0))
    await honestly(gen, 1000, 3, reference)
    assert spot.decode.checked == 1000 and spot.decode.unchecked == 0
    assert spot.decode.caught == 0 and spot.decode.unresolved == 0 and spot.decode.failed == 0
    assert spot.stages.caught == 0 and fitness.snapshot() == {}


def expert_net(worker: Served, tmp_path: Path, rate: float
               ) -> tuple[FakeNet, Fitness, ExpertDispatcher, SpotChecks]:
    """A stage's dispatcher with three replicas of every expert: w (the nearest), w2, w3."""
    names = ("w", "w2", "w3")
    net = FakeNet({}, me=STAGE.peer_id, experts={n: worker for n in names})
    fitness = Fitness(DEFAULTS.unfit_s)
    spot = SpotChecks(DEFAULTS.spot_check_stages, rate, DEFAULTS.spot_tolerance,
                      tmp_path / "spotchecks")
    dispatcher = ExpertDispatcher(
        STAGE, net.holders, net,  # type: ignore[arg-type]
        Latency(STAGE.peer_id, lambda p: 1.0 if p == "w" else 5.0), fitness,
        lambda layer, expert: None, timeout_s=5, wire_dtype="f32", spot_check=rate,
        tolerance=DEFAULTS.spot_tolerance, spot=spot)
    return net, fitness, dispatcher, spot


async def test_a_worker_returning_perturbed_outputs_is_caught_and_left_out_of_the_tally(
        worker: Served, tmp_path: Path) -> None:
    net, fitness, dispatcher, spot = expert_net(worker, tmp_path, DEFAULTS.spot_check)
    net.faults["w"] = lying
    rng = np.random.default_rng(5)
    bound = within(DEFAULTS.spot_check, 0.9999) or 0
    tally = Tally("gw", STAGE.own())
    TALLY.set(tally)  # this task's expert calls are for one session, as a stage's step
    for _ in range(bound):
        rows = rng.standard_normal((2, worker.hp.n_embd)).astype(np.float32)
        ids = np.array([rng.choice(N_EXPERT, 2, replace=False) for _ in range(2)])
        out = await dispatcher.compute(1, 0, N_EXPERT, rows, ids)
        if spot.experts.caught:
            break
    assert spot.experts.caught == 1, f"not caught within {bound} calls"
    evidence = spot.evidence[0]
    assert evidence.peer == "w" and evidence.kind == "experts" and evidence.sessions <= bound
    assert evidence.unit == f"experts 0-{N_EXPERT - 1} of layer 1"
    # the caught call's answer is the judges', and the session's tally pays w nothing
    honest = worker.run_of(1, 0).worker(1, rows, ids)
    assert np.allclose(out, honest, atol=1e-5)
    assert "w" not in tally.experts and set(evidence.checkers) == {"w2", "w3"}
    assert fitness.lied("w")
    calls = spot.sessions["w"]
    await dispatcher.compute(1, 0, N_EXPERT, rows, ids)
    assert spot.sessions["w"] == calls  # avoided
    assert (tmp_path / "spotchecks" / "evidence.jsonl").exists()


async def test_a_thousand_honest_expert_calls_checked_every_time_flag_nobody(
        worker: Served, tmp_path: Path) -> None:
    net, fitness, dispatcher, spot = expert_net(worker, tmp_path, 1.0)
    rng = np.random.default_rng(6)
    TALLY.set(Tally("gw", STAGE.own()))
    for i in range(1000):
        rows = rng.standard_normal((1 + i % 3, worker.hp.n_embd)).astype(np.float32)
        ids = np.array([rng.choice(N_EXPERT, 2, replace=False) for _ in range(len(rows))])
        await dispatcher.compute(i % N_LAYER, 0, N_EXPERT, rows, ids)
    assert spot.experts.checked == 1000 and spot.experts.worst_pass == 0.0
    assert spot.experts.caught == 0 and spot.experts.unresolved == 0
    assert fitness.snapshot() == {} and not (tmp_path / "spotchecks").exists()


def test_a_part_is_checked_on_this_node_first_else_on_a_chain_of_other_holders() -> None:
    rng = random.Random(0)
    held = [PeerHoldings("gw", True, ((0, 2),), ()), PeerHoldings("x", False, ((1, 3),), ()),
            PeerHoldings("y", False, ((2, 4),), ()), PeerHoldings("z", False, ((0, 4),), ())]
    part = Hop("liar", 1, 4, False, True)
    assert cover(part, held, {"liar"}, "gw", rng) == (Hop("z", 1, 4, False, False),
                                                     Hop("gw", 4, 4, False, True))
    assert cover(part, held, {"liar", "z"}, "gw", rng) == (
        Hop("x", 1, 3, False, False), Hop("y", 3, 4, False, False), Hop("gw", 4, 4, False, True))
    first = Hop("liar", 0, 2, True, False)
    assert cover(first, held, {"liar"}, "gw", rng) == (Hop("gw", 0, 2, True, False),)
    assert cover(first, held, {"liar", "gw"}, "gw", rng) is None  # nobody else embeds
    assert cover(part, held[:1], {"liar"}, "gw", rng) is None


def test_a_heads_token_must_be_the_checkers_or_a_near_tie() -> None:
    ref = TokenEvent(5, -0.70, ((5, -0.70), (9, -0.71), (2, -3.0)))
    assert head_agrees(TokenEvent(5), ref, 1e-3, greedy=True)
    assert head_agrees(TokenEvent(9), ref, 1e-3, greedy=True)  # rounding may flip a tie
    assert not head_agrees(TokenEvent(2), ref, 1e-3, greedy=True)
    assert head_agrees(TokenEvent(2), ref, 1e-3, greedy=False)  # a sampled neighbour
    assert not head_agrees(TokenEvent(77), ref, 1e-3, greedy=False)


@pytest.fixture(scope="module")
def heads(model: Path) -> Iterator[dict[str, Served]]:
    """gw: head + layer 0; b: layers 1-2; h, h2 and h3: layer 3 and the head (replicas)."""
    parts = {"gw": Holdings(head=True, windows=((0, 1),)), "b": Holdings(windows=((1, 3),)),
             **{n: Holdings(head=True, windows=((3, 4),)) for n in ("h", "h2", "h3")}}
    out = {name: Served.build([model], h, threads=1, kv_slots=256, remote=no_experts)
           for name, h in parts.items()}
    yield out
    for s in out.values():
        s.close()


def wrong_token(handle: Handle) -> Handle:
    """A head that answers a token half the vocabulary away from the one it drew."""
    async def lie(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        reply = await handle(caller, msg)
        if msg.get("op") == "step" and "token" in reply:
            return {**reply, "token": (reply["token"] + 24_576) % 49_152}
        return reply
    return lie


async def test_a_head_answering_a_token_it_did_not_draw_is_caught(
        heads: dict[str, Served], reference: list[int]) -> None:
    net, fitness = FakeNet(heads), Fitness(DEFAULTS.unfit_s)
    net.faults["h"] = wrong_token
    spot = SpotChecks(1.0, 0.0, DEFAULTS.spot_tolerance)
    gen = SwarmGenerator(net.me, lambda: ModelInfo("m", "test", 256), lambda: N_LAYER,
                         net.holders, net, net.servers[net.me].handle,  # type: ignore[arg-type]
                         Latency(net.me, lambda p: 1.0 if p == "h" else 5.0), fitness,
                         InferenceConfig(spot_check_stages=1.0), net.inbox, spot=spot)
    assert await generate(gen, "r", 4) == reference[:4]  # replayed without h
    assert [e.peer for e in spot.evidence] == ["h"] and fitness.lied("h")
    assert spot.evidence[0].unit == "layer 3 + head"
    assert "h" not in {w.peer for w in gen.work("r")}


async def test_a_checker_contradicted_by_a_second_is_the_one_caught(
        replicated: dict[str, Served], reference: list[int]) -> None:
    """b2 lies as a checker of the honest b: when it is drawn first, b3 agrees with b, and
    b2 is caught, never b."""
    opened: list[str] = []
    net, fitness = FakeNet(replicated), Fitness(DEFAULTS.unfit_s)
    net.faults["b2"] = perturbing(opened, "b2")
    spot = SpotChecks(1.0, 0.0, DEFAULTS.spot_tolerance)
    gen = generator(net, spot, fitness, InferenceConfig(spot_check_stages=1.0))
    for i in range(40):  # b2 is the first checker of a session with probability 1/2
        assert await generate(gen, f"r{i}") == reference[:3]
        if spot.stages.caught:
            break
    assert [e.peer for e in spot.evidence] == ["b2"] and set(spot.evidence[0].checkers) == \
        {"b", "b3"}
    assert fitness.lied("b2") and fitness.fit("b")


class LyingOnDecode(StageServer):
    """A stage that computes every relayed step (the route's first prompt chunk, a check's
    recomputation) honestly and each decode step forwarded to it on garbage in place of the
    rows it was sent; it writes down what it really received and sent (it reads the code:
    a commitment that contradicts its neighbours' costs it its pay at once)."""

    rng = np.random.default_rng(3)
    opened: list[str] = []

    async def answer(self, caller: str, m: Any) -> dict[str, Any]:
        if isinstance(m, Open):
            LyingOnDecode.opened.append(self.me)
        return await super().answer(caller, m)

    async def _step(self, s: Any, m: Any, *rest: Any) -> Any:
        if m.forward is not None and m.dt != "i32" and len(m.x) == 1:
            m = dataclasses.replace(m, x=self.rng.permutation(m.x, axis=1))
        return await super()._step(s, m, *rest)


@pytest.fixture(scope="module")
def tails(model: Path) -> Iterator[dict[str, Served]]:
    """gw: head + layer 0; d, d2 and d3: layers 1-3 and the head (replicas): a route is gw
    and one peer."""
    parts = {"gw": Holdings(head=True, windows=((0, 1),)),
             **{n: Holdings(head=True, windows=((1, N_LAYER),)) for n in ("d", "d2", "d3")}}
    out = {name: Served.build([model], h, threads=1, kv_slots=256, remote=no_experts)
           for name, h in parts.items()}
    yield out
    for s in out.values():
        s.close()


def tail_generator(net: FakeNet, spot: SpotChecks, fitness: Fitness,
                   config: InferenceConfig = DEFAULTS) -> SwarmGenerator:
    """The gateway's generator over `tails` (d is nearer than its replicas)."""
    return SwarmGenerator(net.me, lambda: ModelInfo("m", "test", 256), lambda: N_LAYER,
                          net.holders, net, net.servers[net.me].handle,  # type: ignore[arg-type]
                          Latency(net.me, lambda p: 1.0 if p == "d" else 5.0), fitness,
                          config, net.inbox, spot=spot)


async def test_a_stage_lying_only_on_decode_steps_is_caught_and_paid_nothing(
        tails: dict[str, Served], reference: list[int], tmp_path: Path) -> None:
    """d passes every first-chunk check; with the default rate, the rows it shows for a
    drawn session, recomputed on a replica, catch it within the sessions
    docs/verification.md predicts."""
    opened = LyingOnDecode.opened = []
    net, fitness = FakeNet(tails, servers={"d": LyingOnDecode}), Fitness(DEFAULTS.unfit_s)
    spot = SpotChecks(DEFAULTS.spot_check_stages, DEFAULTS.spot_check,
                      DEFAULTS.spot_tolerance, tmp_path / "spotchecks")
    gen = tail_generator(net, spot, fitness)
    bound = within(DEFAULTS.spot_check_stages, 0.9999) or 0
    lied = False
    for i in range(bound):
        tokens = await generate(gen, f"r{i}", 6)
        lied = lied or tokens != reference[:6]
        work = {w.peer: w.units for w in gen.work(f"r{i}")}
        if spot.decode.caught:
            break
        assert "d" in work
    assert lied  # its lies changed what the users were sent
    assert spot.decode.caught == 1, f"not caught within {bound} sessions"
    assert spot.stages.caught == 0 and spot.stages.checked >= 1  # its first chunks are honest
    evidence = spot.evidence[0]
    assert evidence.kind == "decode" and evidence.peer == "d"
    assert evidence.unit == "layers 1-3 + head (decode steps)" and evidence.sessions <= bound
    # nothing paid to d for the caught session; the checkers paid for their work
    assert "d" not in work and set(evidence.checkers) <= {"d2", "d3"}
    assert all(work[p] > 0 for p in evidence.checkers)
    assert fitness.lied("d")
    sessions = len(opened)
    assert await generate(gen, "after", 6) == reference[:6]
    assert len(opened) == sessions  # avoided
    kept = json.loads((tmp_path / "spotchecks" / "evidence.jsonl").read_text().splitlines()[0])
    assert kept["kind"] == "decode" and kept["peer"] == "d" and kept["verdict"] == "caught"
    arrays = np.load(tmp_path / "spotchecks" / kept["arrays"])
    assert len(PROMPT) < len(arrays["input"]) < len(PROMPT) + 6  # the inputs it showed
    assert arrays["output"][0][0] != arrays["reference"][0][0]  # the tokens that differ


async def test_a_stage_lying_on_decode_steps_on_a_route_of_several_peers_is_caught(
        replicated: dict[str, Served], reference: list[int]) -> None:
    """b lies on the decode steps forwarded to it on a route with c: what b showed of a
    drawn step, recomputed on a replica from the inputs it showed (which are bound by what
    the hop before it sent), names b; c, honest, is paid and not flagged."""
    LyingOnDecode.opened = []
    net, fitness = FakeNet(replicated, servers={"b": LyingOnDecode}), Fitness(DEFAULTS.unfit_s)
    spot = SpotChecks(1.0, 0.0, DEFAULTS.spot_tolerance)
    gen = generator(net, spot, fitness, InferenceConfig(spot_check_stages=1.0))
    assert await generate(gen, "r", 6) != reference[:6]  # its lies reached the user
    assert spot.stages.caught == 0 and spot.decode.caught == 1 and spot.decode.unshown == 0
    assert [e.peer for e in spot.evidence] == ["b"]
    assert spot.evidence[0].unit == "layers 1-2 (decode steps)"
    assert set(spot.evidence[0].checkers) <= {"b2", "b3"}
    assert spot.unchecked == {"layer 3": 1, "layer 3 (decode steps)": 1}  # c has no replica
    work = {w.peer for w in gen.work("r")}
    assert "b" not in work and "c" in work
    assert fitness.lied("b") and fitness.fit("c")


async def test_a_hop_whose_commitment_contradicts_what_it_sent_is_paid_nothing(
        replicated: dict[str, Served], reference: list[int]) -> None:
    """b answers the relayed steps with rows other than those it wrote down (a fault in
    front of its server): the gateway saw what b sent, so b alone cannot show its work and
    is paid nothing, though no check was drawn; c, which computed on what b sent, is paid."""
    net, fitness = FakeNet(replicated), Fitness(DEFAULTS.unfit_s)
    net.faults["b"] = perturbing([], "b")
    spot = SpotChecks(0.0, 0.0, DEFAULTS.spot_tolerance)
    gen = generator(net, spot, fitness, InferenceConfig(spot_check_stages=0.0))
    await generate(gen, "r", 3)
    assert spot.decode.unshown == 1 and spot.stages.checked == 0
    work = {w.peer for w in gen.work("r")}
    assert "b" not in work and {"gw", "c"} <= work


async def test_after_a_failover_the_last_routes_own_steps_are_checked_and_pass(
        tails: dict[str, Served], reference: list[int]) -> None:
    """d stops answering at the fourth generated token; the generation goes on on a replica,
    whose later steps (the failover's replay and the tokens it generated after it) are
    checked on the third from the rows it shows, flagging nobody."""
    net, fitness = FakeNet(tails), Fitness(DEFAULTS.unfit_s)
    net.faults["d"] = hung(lambda m: m.get("op") == "step" and m["start"] == len(PROMPT) + 2)
    spot = SpotChecks(1.0, 0.0, DEFAULTS.spot_tolerance)
    gen = tail_generator(net, spot, fitness,
                         InferenceConfig(spot_check_stages=1.0, step_timeout_s=1.0))
    assert await generate(gen, "r", 6) == reference[:6]
    assert not fitness.fit("d") and not fitness.lied("d")  # failed over, as a failure
    assert spot.decode.seen == 1 and spot.decode.checked == 1
    assert spot.decode.caught == 0 and spot.decode.unresolved == 0 and spot.decode.failed == 0
    assert "d" in {w.peer for w in gen.work("r")}  # paid for what it did before it failed


def test_a_peer_that_keeps_failing_checks_fills_no_disk(tmp_path: Path) -> None:
    spot = SpotChecks(1.0, 1.0, DEFAULTS.spot_tolerance, tmp_path / "spotchecks")
    spot.disk_bytes, spot.log_bytes = 100_000, 4_000
    noise = np.random.default_rng(0)
    for i in range(60):
        rows = noise.standard_normal((8, 256)).astype(np.float32)  # ~23 kB for the three
        spot.caught("stage", "liar", "layers 0-1", ["c"], rows, rows + 1, rows, 1.0)
    kept = sorted((tmp_path / "spotchecks").glob("*.npz"))
    assert sum(f.stat().st_size for f in kept) <= spot.disk_bytes and len(kept) >= 2
    assert spot.stages.caught == 60
    logs = [tmp_path / "spotchecks" / n for n in ("evidence.jsonl", "evidence.jsonl.1")]
    assert all(f.exists() and f.stat().st_size < spot.log_bytes + 1_000 for f in logs)
    newest = json.loads(logs[0].read_text().splitlines()[-1])
    assert (tmp_path / "spotchecks" / newest["arrays"]).exists()


async def test_honest_speculating_sessions_checked_every_time_flag_nobody(
        replicated: dict[str, Served]) -> None:
    """Lookup checks of four guesses on a route of three hops, each check's rows sent on a
    row at a time and the head answering at its first miss: every hop still commits to
    every step as the gateway sent it, and the drawn steps recomputed pass."""
    net, fitness = FakeNet(replicated), Fitness(DEFAULTS.unfit_s)
    spot = SpotChecks(1.0, 0.0, DEFAULTS.spot_tolerance)
    gen = generator(net, spot, fitness, InferenceConfig(
        spot_check_stages=1.0, speculate="lookup", draft_k=4))
    for i in range(12):
        await generate(gen, f"r{i}", 40)
    assert gen.speculation["accepted"] < gen.speculation["guessed"]
    assert net.servers["c"].rows_apart > 0
    assert spot.decode.checked > 0 and spot.decode.caught == 0
    assert spot.decode.unshown == 0 and spot.decode.unresolved == 0
    assert fitness.snapshot() == {}

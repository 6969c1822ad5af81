"""The gateway's side of a forwarded route, in process: stage servers of named peers joined
by an in-process transport that can lose a peer or a single link (fakenet).

The daemons' own tests (tests/integration/test_swarm.py) run the same path over libp2p and
lanes; here each failure is placed exactly, to check whom the gateway blames for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from trio.testing import MockClock

from kvasird.compute.sampling import SamplingParams
from kvasird.config import InferenceConfig
from kvasird.inference.api import (
    Busy,
    Finished,
    GenerationError,
    GenerationRequest,
    ModelInfo,
    NoRoute,
    Sampling,
    TokenEvent,
)
from kvasird.inference.client.routing import Fitness, Latency
from kvasird.inference.client.swarm import SwarmGenerator
from kvasird.inference.errors import FAILED_S, UNREACHABLE_S, Refusal
from kvasird.inference.server.engine import Holdings, Served

from .conftest import N_LAYER, PROMPT
from .fakenet import FakeNet, hung, no_experts


def generator(net: FakeNet, fitness: Fitness) -> SwarmGenerator:
    """The gateway's generator over `net`'s coverage map (b is nearer than its replica b2),
    one position a step (speculation, which steps several, is test_speculate's)."""
    return SwarmGenerator(net.me, lambda: ModelInfo("m", "test", 256), lambda: N_LAYER,
                          net.holders, net, net.servers[net.me].handle,  # type: ignore[arg-type]
                          Latency(net.me, lambda p: {"b": 1.0, "b2": 5.0}.get(p, 1.0)),
                          fitness, InferenceConfig(speculate="off"), net.inbox)


async def run(gen: SwarmGenerator, n: int, on_token: Any = None) -> list[int]:
    """Greedy tokens of one generation through `gen`, its net's messages in flight meanwhile."""
    net: FakeNet = gen.channels  # type: ignore[assignment]
    req = GenerationRequest("m", tuple(PROMPT), Sampling(SamplingParams(temperature=0), n))
    tokens: list[int] = []
    failed: GenerationError | None = None
    async with net.running() as nursery:
        gen.nursery = nursery
        try:
            async for event in gen.generate(req):
                if isinstance(event, TokenEvent):
                    tokens.append(event.token)
                    if on_token is not None:
                        on_token(len(tokens))
                else:
                    assert isinstance(event, Finished) and event.completion_tokens == n
        except GenerationError as exc:
            failed = exc
    if failed is not None:
        raise failed
    return tokens


async def token_events(net: FakeNet, request: GenerationRequest,
                       on_token: Any = None) -> list[TokenEvent]:
    """The token events of one generation through `net` (the sessions it cut off freed)."""
    gen = generator(net, Fitness(300))
    out: list[TokenEvent] = []
    async with net.running() as nursery:
        gen.nursery = nursery
        async for event in gen.generate(request):
            if isinstance(event, TokenEvent):
                out.append(event)
                if on_token is not None:
                    on_token(len(out))
    for server in net.servers.values():  # a dead peer's sessions: free their KV
        server.close_all()
    return out


def at_token(n: int, act: Callable[[], object]) -> Callable[[int], None]:
    """An on_token callback that does `act` when the n-th token is out."""
    def on_token(k: int) -> None:
        if k == n:
            act()
    return on_token


async def test_a_forwarded_route_generates_the_tokens_of_the_whole_model(
        served: dict[str, Served], reference: list[int]) -> None:
    net = FakeNet({k: v for k, v in served.items() if k != "b2"})
    assert await run(generator(net, Fitness(300)), 10) == reference
    # b and c forwarded every step but the relayed ones, which the gateway times hop by hop
    assert net.servers["b"].forwarded >= 8 and net.servers["c"].forwarded >= 8
    assert all(s.sessions == {} for s in net.servers.values())


async def test_every_hops_session_opens_at_once(
        served: dict[str, Served], reference: list[int]) -> None:
    """The opens of a route's sessions overlap (one round trip before the prefill, not one
    a hop): b's and c's opens both arrive before either is answered."""
    net = FakeNet({k: v for k, v in served.items() if k != "b2"})
    seen: list[tuple[str, str]] = []

    def slow_open(peer: str) -> Any:
        def fault(handle: Any) -> Any:
            async def slow(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
                if msg.get("op") != "open":
                    return await handle(caller, msg)
                seen.append(("in", peer))
                await trio.sleep(0.2)
                seen.append(("out", peer))
                return await handle(caller, msg)
            return slow
        return fault

    net.faults["b"], net.faults["c"] = slow_open("b"), slow_open("c")
    assert await run(generator(net, Fitness(300)), 3) == reference[:3]
    assert [kind for kind, _ in seen[:2]] == ["in", "in"], seen


async def test_windows_that_overlap_chain_and_generate_the_tokens_of_the_whole_model(
        model: Path, served: dict[str, Served], reference: list[int]) -> None:
    """d holds layers 2-3, overlapping b's 1-2: with c gone the route enters d's window at
    layer 3, a part of the stage d loaded."""
    d = Served.build([model], Holdings(windows=((2, 4),)), threads=1, kv_slots=256,
                     remote=no_experts)
    try:
        net = FakeNet({"gw": served["gw"], "b": served["b"], "d": d})
        gen = generator(net, Fitness(300))
        assert await run(gen, 10) == reference
        assert gen.traces.summary()["route"] == ["gw", "b", "d", "gw"]
    finally:
        d.close()


async def test_traced_steps_say_where_each_hops_time_went(
        served: dict[str, Served], reference: list[int]) -> None:
    net = FakeNet({k: v for k, v in served.items() if k != "b2"})
    gen = generator(net, Fitness(300))
    assert (await run(gen, 16))[:10] == reference
    view = gen.traces.summary()
    assert view["route"] == ["gw", "b", "c", "gw"]  # the head at the end is the gateway's
    assert view["steps"] >= 2 and len(view["hops"]) == 4
    # b computes two layers, c one: each traced hop's compute is its own
    assert all(h["compute_ms"] > 0 for h in view["hops"])
    assert view["total_ms"] >= view["wire_ms"] + sum(h["compute_ms"] for h in view["hops"]) - 1e-3


async def test_a_dead_stage_is_blamed_and_the_replica_continues_the_same_tokens(
        served: dict[str, Served], reference: list[int], mock_clock: MockClock) -> None:
    mock_clock.rate = 1  # real time, and jumps to see the sentence end
    net, fitness = FakeNet(served), Fitness(300)

    # the preferred replica (lower latency) dies mid-generation
    assert await run(generator(net, fitness), 10,
                     at_token(4, lambda: net.down.add("b"))) == reference
    assert set(fitness.snapshot()) == {"b"}
    # a failure at work is a short sentence (a restart, a peer still loading), not unfit_s:
    # back up, b is routed to again, and having worked its next failure starts over
    mock_clock.jump(FAILED_S - 1)
    assert not fitness.fit("b")
    mock_clock.jump(2)
    assert fitness.fit("b") and fitness.strikes == {"b": 1}
    net.down.discard("b")
    gen = generator(net, fitness)
    assert await run(gen, 10) == reference
    assert gen.traces.summary()["route"][1] == "b" and fitness.strikes == {}


@pytest.mark.parametrize("params", [SamplingParams(temperature=0),
                                    SamplingParams(temperature=0.9, top_k=20, seed=7)],
                         ids=["greedy", "seeded"])
async def test_a_failover_replays_the_bits_of_an_undisturbed_run(
        served: dict[str, Served], params: SamplingParams) -> None:
    """b dies after 7 tokens; its replica rebuilds the KV from the replay. The tokens and
    log probabilities of every later token are the undisturbed run's to the last bit (a
    replay of the generated tokens as one prefill rounds differently: ~1e-5 on this f32
    model), and a seeded stream continues where it was."""
    async def logprobs(net: FakeNet, on_token: Any = None) -> list[tuple[int, float]]:
        req = GenerationRequest("m", tuple(PROMPT), Sampling(params, 14, logprobs=2))
        out = await token_events(net, req, on_token)
        assert all(e.logprob is not None for e in out)
        return [(e.token, e.logprob) for e in out]  # type: ignore[misc]

    undisturbed = await logprobs(FakeNet(served))
    net = FakeNet(served)
    replayed = await logprobs(net, at_token(7, lambda: net.down.add("b")))
    assert "b" in net.down and replayed == undisturbed


async def test_a_failover_waits_for_a_replica_missing_from_the_map_for_a_moment(
        served: dict[str, Served], reference: list[int]) -> None:
    """b dies while its replica b2 is not in the coverage map (its record late: under load,
    or held up behind a hung peer); b2 shows up 0.6 s after the failure and the generation
    goes on with it instead of stopping."""
    net, fitness = FakeNet(served), Fitness(300)
    net.unlisted.add("b2")
    listed: list[float] = []

    async def list_b2_later() -> None:
        await trio.sleep(0.6)
        net.unlisted.discard("b2")
        listed.append(trio.current_time())

    def kill(n: int) -> None:
        if n == 4:
            net.down.add("b")
            assert net.nursery is not None
            net.nursery.start_soon(list_b2_later)

    assert await run(generator(net, fitness), 10, kill) == reference
    assert set(fitness.snapshot()) == {"b"}
    assert listed  # the generation waited for b2 (it would have been cancelled at the end)


async def test_a_route_out_of_capacity_answers_busy_at_once(
        served: dict[str, Served]) -> None:
    """c, the only holder of layer 3, runs out of KV mid-generation: the client hears Busy
    (retry shortly) right away; only a failed route waits for coverage to come back."""
    net, fitness = FakeNet(served), Fitness(300)
    full = trio.Event()
    real = net.servers["c"]._step

    async def refusing(session: Any, msg: dict[str, Any], *rest: Any) -> dict[str, Any]:
        if full.is_set():
            raise Refusal("busy", "KV cache has 0 free slots")
        return await real(session, msg, *rest)

    net.servers["c"]._step = refusing  # type: ignore[method-assign]

    gen = generator(net, fitness)
    began = trio.current_time()
    with trio.fail_after(20), pytest.raises(Busy, match="KV cache"):
        await run(gen, 10, at_token(4, full.set))
    assert trio.current_time() - began < gen.config.step_timeout_s / 2


async def test_a_stage_that_cannot_reach_the_next_one_is_blamed_when_we_can(
        served: dict[str, Served], reference: list[int], mock_clock: MockClock) -> None:
    """b says it cannot reach c; the gateway reaches c itself, so the fault is b's link:
    b (not c) is avoided, for the short sentence of an unreachable peer."""
    mock_clock.rate = 1  # real time, and a jump past the short sentence
    net, fitness = FakeNet(served), Fitness(300)

    assert await run(generator(net, fitness), 10,
                     at_token(4, lambda: net.cut.add(("b", "c")))) == reference
    assert set(fitness.snapshot()) == {"b"}
    assert "answers us" in fitness.snapshot()["b"]
    mock_clock.jump(UNREACHABLE_S)
    assert fitness.fit("b")


async def test_a_peer_that_failed_once_is_a_last_resort_and_a_liar_never(
        served: dict[str, Served], reference: list[int]) -> None:
    """c, the only holder of layer 3, timed out once (slowed by its machine): a route
    through it beats no route. Twice in a row, or caught lying, and it is not used."""
    net, fitness = FakeNet({k: v for k, v in served.items() if k != "b2"}), Fitness(300)
    fitness.failed("c", "no result within 10 s", first_s=FAILED_S)
    assert await run(generator(net, fitness), 10) == reference
    assert fitness.strikes == {}  # it worked: forgiven
    fitness.failed("c", "no result within 10 s", first_s=FAILED_S)
    fitness.failed("c", "no result within 10 s", first_s=FAILED_S)
    with pytest.raises(NoRoute):
        generator(net, fitness).plan()
    liar = Fitness(300)
    liar.mark("c", "spot check failed")
    with pytest.raises(NoRoute):
        generator(net, liar).plan()


async def test_a_silent_chain_is_probed_and_the_hop_that_did_not_compute_is_blamed(
        served: dict[str, Served], reference: list[int]) -> None:
    """c takes the step but never answers nor forwards (hung after receiving): the probe
    finds that c has not computed the position and, at the step timeout, replaces it."""
    net, fitness = FakeNet(served), Fitness(300)
    hang = trio.Event()
    net.faults["c"] = hung(lambda msg: hang.is_set() and msg.get("op") == "step")

    gen = generator(net, fitness)
    gen.config = InferenceConfig(step_timeout_s=1.0)
    with trio.fail_after(20), pytest.raises(GenerationError, match="no other peers"):
        # c is the only holder of layer 3: no route is left once it is out
        await run(gen, 10, at_token(4, hang.set))
    # found by the probe during a decode step; tried again as the last resort, it hangs on
    # the new route's first prompt chunk, which is relayed (spotcheck) and times out
    assert "c" in fitness.snapshot() and fitness.strikes["c"] == 2
    assert np.isfinite(gen.latency("b"))

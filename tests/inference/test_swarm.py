"""The gateway's side of a forwarded route, in process: stage servers of named peers joined
by an in-process transport that can lose a peer or a single link.

The daemons' own tests (tests/integration/test_swarm.py) run the same path over libp2p and
lanes; here each failure is placed exactly, to check whom the gateway blames for it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from kvasird.compute.kvcache import KVSpec
from kvasird.compute.stage import Stage, generate
from kvasird.config import InferenceConfig
from kvasird.errors import KvasirError
from kvasird.inference.api import (
    Busy,
    Finished,
    GenerationError,
    GenerationRequest,
    ModelInfo,
    Sampling,
    TokenEvent,
)
from kvasird.inference.client.routing import Fitness, Latency, PeerHoldings
from kvasird.inference.client.swarm import Inbox, SwarmGenerator
from kvasird.inference.errors import UNREACHABLE_S, Refused, Unreachable
from kvasird.inference.server.engine import Holdings, Served
from kvasird.inference.server.stage import StageServer
from kvasird.model.testmodels import make_model

N_LAYER = 4
PROMPT = [3, 1, 4, 1, 5, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "dense.gguf", arch="llama",
                      n_layer=N_LAYER, dtype="f32")


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[dict[str, Served]]:
    """gw: head + layers 0-1; b and b2: layers 1-3 (replicas); c: layer 3."""
    parts = {"gw": Holdings(head=True, windows=((0, 1),)), "b": Holdings(windows=((1, 3),)),
             "b2": Holdings(windows=((1, 3),)), "c": Holdings(windows=((3, 4),))}
    out = {name: Served.build([model], h, threads=1, kv_slots=256, remote=_no_experts)
           for name, h in parts.items()}
    yield out
    for s in out.values():
        s.close()


def _no_experts(layer: int, first: int, end: int) -> Any:
    raise AssertionError("a dense model dispatches nothing")


class Net:
    """Named peers' stage servers; `down` peers and `cut` links (from, to) refuse to connect."""

    def __init__(self, served: dict[str, Served], me: str = "gw") -> None:
        self.me, self.inbox = me, Inbox()
        self.nursery: trio.Nursery | None = None
        """Where messages in flight are handled (set by `running`)."""
        self.down: set[str] = set()
        self.cut: set[tuple[str, str]] = set()
        self.servers = {n: StageServer(lambda: "m", lambda s=s: s, max_sessions=8, idle_s=60,
                                       wire_dtype="f32", me=n, send=self._sender(n),
                                       deliver=self.inbox.deliver if n == me else None)
                        for n, s in served.items()}

    def _reach(self, src: str, dst: str) -> None:
        if dst in self.down or (src, dst) in self.cut:
            raise Unreachable(dst, "connection refused")

    def _sender(self, src: str):  # noqa: ANN202 - a serving.Send
        async def send(peer: str, msg: dict[str, Any]) -> None:
            self._reach(src, peer)
            assert self.nursery is not None
            self.nursery.start_soon(self._arrive, peer, src, msg)  # sent: not waited for
        return send

    async def _arrive(self, peer: str, src: str, msg: dict[str, Any]) -> None:
        with contextlib.suppress(KvasirError):  # a one-way message's failure is its own
            await self.servers[peer].handle(src, msg)

    # what SwarmGenerator uses of Channels
    async def request(self, peer: str, protocol: str, msg: dict[str, Any],
                      wait_s: float) -> dict[str, Any]:
        self._reach(self.me, peer)
        try:
            return await self.servers[peer].handle(self.me, msg)
        except Refused as exc:
            raise Refused(peer, exc.code, exc.detail) from None

    async def notify(self, peer: str, protocol: str, msg: dict[str, Any], wait_s: float) -> None:
        await self._sender(self.me)(peer, msg)

    def generator(self, served: dict[str, Served], fitness: Fitness) -> SwarmGenerator:
        holders = [PeerHoldings(n, s.holdings.head, s.holdings.windows, ())
                   for n, s in served.items() if n in self.servers]
        return SwarmGenerator(self.me, lambda: ModelInfo("m", "test", 256), lambda: N_LAYER,
                              lambda: holders, self, self.servers[self.me].handle,  # type: ignore[arg-type]
                              Latency(self.me, lambda p: {"b": 1.0, "b2": 5.0}.get(p, 1.0)),
                              fitness, InferenceConfig(), self.inbox)


async def run(gen: SwarmGenerator, n: int, on_token: Any = None) -> list[int]:
    """Greedy tokens of one generation through `gen`, its net's messages in flight meanwhile."""
    net = gen.channels
    req = GenerationRequest("m", tuple(PROMPT), Sampling(temperature=0, max_tokens=n))
    tokens: list[int] = []
    failed: GenerationError | None = None
    async with trio.open_nursery() as nursery:
        net.nursery = gen.nursery = nursery  # type: ignore[attr-defined]
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
        finally:
            nursery.cancel_scope.cancel()
    if failed is not None:
        raise failed
    return tokens


def at_token(n: int, act: Callable[[], object]) -> Callable[[int], None]:
    """An on_token callback that does `act` when the n-th token is out."""
    def on_token(k: int) -> None:
        if k == n:
            act()
    return on_token


@pytest.fixture(scope="module")
def reference(model: Path) -> list[int]:
    full = Stage.load(model, threads=1, kv=KVSpec(n_slots=256, dtype="f32"))
    try:
        return generate(full, PROMPT, 10)
    finally:
        full.close()


async def test_a_forwarded_route_generates_the_tokens_of_the_whole_model(
        served: dict[str, Served], reference: list[int]) -> None:
    net = Net({k: v for k, v in served.items() if k != "b2"})
    assert await run(net.generator(served, Fitness(300)), 10) == reference
    # b and c forwarded every step but the relayed ones, which the gateway times hop by hop
    assert net.servers["b"].forwarded >= 8 and net.servers["c"].forwarded >= 8
    assert all(s.sessions == {} for s in net.servers.values())


async def test_traced_steps_say_where_each_hops_time_went(
        served: dict[str, Served], reference: list[int]) -> None:
    net = Net({k: v for k, v in served.items() if k != "b2"})
    gen = net.generator(served, Fitness(300))
    assert (await run(gen, 16))[:10] == reference
    view = gen.traces.summary()
    assert view["route"] == ["gw", "b", "c", "gw"]  # the head at the end is the gateway's
    assert view["steps"] >= 2 and len(view["hops"]) == 4
    # b computes two layers, c one: each traced hop's compute is its own
    assert all(h["compute_ms"] > 0 for h in view["hops"])
    assert view["total_ms"] >= view["wire_ms"] + sum(h["compute_ms"] for h in view["hops"]) - 1e-3


async def test_a_dead_stage_is_blamed_and_the_replica_continues_the_same_tokens(
        served: dict[str, Served], reference: list[int]) -> None:
    net, fitness = Net(served), Fitness(300)

    # the preferred replica (lower latency) dies mid-generation
    assert await run(net.generator(served, fitness), 10,
                     at_token(4, lambda: net.down.add("b"))) == reference
    assert set(fitness.snapshot()) == {"b"}
    assert fitness._until["b"][0] - time.monotonic() > UNREACHABLE_S  # the full sentence


async def test_a_failover_waits_for_a_replica_missing_from_the_map_for_a_moment(
        served: dict[str, Served], reference: list[int]) -> None:
    """b dies while its replica b2 is not in the coverage map (its record late: under load,
    or held up behind a hung peer); b2 shows up 0.6 s after the failure and the generation
    goes on with it instead of stopping."""
    net, fitness = Net(served), Fitness(300)
    gen = net.generator(served, fitness)
    every = gen.holders
    shown_at: list[float] = []

    def holders() -> list[PeerHoldings]:
        late = not shown_at or trio.current_time() < shown_at[0]
        return [h for h in every() if not (late and h.peer == "b2")]

    def kill(n: int) -> None:
        if n == 4:
            net.down.add("b")
            shown_at.append(trio.current_time() + 0.6)

    gen.holders = holders  # type: ignore[method-assign]
    assert await run(gen, 10, kill) == reference
    assert set(fitness.snapshot()) == {"b"}
    assert trio.current_time() >= shown_at[0]


async def test_a_route_out_of_capacity_answers_busy_at_once(
        served: dict[str, Served]) -> None:
    """c, the only holder of layer 3, runs out of KV mid-generation: the client hears Busy
    (retry shortly) right away; only a failed route waits for coverage to come back."""
    net, fitness = Net(served), Fitness(300)
    full = trio.Event()
    real = net.servers["c"]._step

    async def refusing(session: Any, msg: dict[str, Any]) -> dict[str, Any]:
        if full.is_set():
            raise Refused("", "busy", "KV cache has 0 free slots")
        return await real(session, msg)

    net.servers["c"]._step = refusing  # type: ignore[method-assign]

    gen = net.generator(served, fitness)
    began = trio.current_time()
    with trio.fail_after(20), pytest.raises(Busy, match="KV cache"):
        await run(gen, 10, at_token(4, full.set))
    assert trio.current_time() - began < gen.config.step_timeout_s / 2


async def test_a_stage_that_cannot_reach_the_next_one_is_blamed_when_we_can(
        served: dict[str, Served], reference: list[int]) -> None:
    """b says it cannot reach c; the gateway reaches c itself, so the fault is b's link:
    b (not c) is avoided, for the short sentence of an unreachable peer."""
    net, fitness = Net(served), Fitness(300)

    assert await run(net.generator(served, fitness), 10,
                     at_token(4, lambda: net.cut.add(("b", "c")))) == reference
    assert set(fitness.snapshot()) == {"b"}
    assert "answers us" in fitness.snapshot()["b"]
    left = fitness._until["b"][0] - time.monotonic()
    assert 0 < left <= UNREACHABLE_S


async def test_a_silent_chain_is_probed_and_the_hop_that_did_not_compute_is_blamed(
        served: dict[str, Served], reference: list[int]) -> None:
    """c takes the step but never answers nor forwards (hung after receiving): the probe
    finds that c has not computed the position and, at the step timeout, replaces it."""
    net, fitness = Net(served), Fitness(300)
    hang = trio.Event()
    real = net.servers["c"].handle

    async def hung(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        if hang.is_set() and msg.get("op") == "step":
            await trio.sleep_forever()
        return await real(caller, msg)

    net.servers["c"].handle = hung  # type: ignore[method-assign]

    gen = net.generator(served, fitness)
    gen.config = InferenceConfig(step_timeout_s=1.0)
    with trio.fail_after(20), pytest.raises(GenerationError, match="no other peers"):
        # c is the only holder of layer 3: no route is left once it is out
        await run(gen, 10, at_token(4, hang.set))
    assert "c" in fitness.snapshot() and "position" in fitness.snapshot()["c"]
    assert np.isfinite(gen.latency("b"))

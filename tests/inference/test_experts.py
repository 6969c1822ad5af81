"""The stage's hot-expert cache: what it plans to hold, and how its experts are computed
next to remote ones (real workers over a real libp2p channel)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import trio

from kvasird.compute.experts import ExpertWorker
from kvasird.compute.graph import Backend
from kvasird.compute.weights import EXPERT_SUFFIXES, load_weights
from kvasird.inference.client.dispatch import ExpertDispatcher
from kvasird.inference.client.hotcache import HOT_RETRY_S, HotExperts, plan_cache, stack_rows
from kvasird.inference.server.engine import Served
from tests.support import Clock

from .conftest import N_EXPERT, N_LAYER
from .fakenet import NETWORK
from .test_serving import expert_server


def top_k(rng: np.random.Generator, n: int, k: int, p: np.ndarray | None = None) -> np.ndarray:
    return np.array([rng.choice(N_EXPERT, k, replace=False, p=p) for _ in range(n)])


def local_share(rows: dict[int, np.ndarray], cached: set[tuple[int, int]]) -> float:
    """Of all rows, those whose every selected expert is cached (no round trip)."""
    whole = sum(sum(all((lay, int(e)) in cached for e in row) for row in r)
                for lay, r in rows.items())
    return whole / sum(len(r) for r in rows.values())


def test_under_even_routing_the_plan_completes_a_layer_instead_of_halving_two() -> None:
    rng = np.random.default_rng(0)
    rows = {0: top_k(rng, 256, 2), 1: top_k(rng, 256, 2)}
    plan = plan_cache(rows, N_EXPERT)
    assert len(plan) == N_EXPERT and len({lay for lay, _ in plan}) == 1
    assert local_share(rows, set(plan)) == 0.5  # one layer of two: half the round trips
    counts = {(lay, int(e)): int((r == e).sum()) for lay, r in rows.items() for e in range(8)}
    popular = set(sorted(counts, key=counts.__getitem__)[-N_EXPERT:])
    assert local_share(rows, popular) < 0.35  # the most selected experts spare far fewer


def test_under_skewed_routing_the_plan_takes_the_pairs_that_come_up_together() -> None:
    rng = np.random.default_rng(1)
    p = np.array([0.4, 0.3] + [0.05] * 6)
    rows = {0: top_k(rng, 256, 2, p), 1: top_k(rng, 256, 2, p)}
    assert set(plan_cache(rows, 4)) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert plan_cache(rows, 0) == [] and plan_cache({}, 4) == []
    assert len(plan_cache(rows, 100)) == 2 * N_EXPERT  # no more than was ever selected


async def test_calls_for_part_of_a_layer_send_narrower_rows_and_plan_the_same(
        moe: Path) -> None:
    """A stage holding half a layer's experts dispatches the other half: a row with one
    expert there comes padded ([e, e]) or alone ([e]), as compute.experts packs it."""
    parts = [np.array([[5, 6]]), np.array([[7]]), np.array([[5, 5], [6, 7]])]
    assert stack_rows(parts).tolist() == [[5, 6], [7, 7], [5, 5], [6, 7]]
    assert plan_cache({0: stack_rows(parts), 1: np.array([[1]])}, 3) == [(0, 5), (0, 6),
                                                                         (0, 7)]
    backend, made = Backend(1), []
    hot = HotExperts(loader(moe, backend, made), capacity=3, after=1)
    try:
        for part in parts * 3:
            await hot.observe(0, part)
        assert set(hot.workers) == {(0, 5), (0, 6), (0, 7)}
    finally:
        hot.close()
        backend.close()


def loader(moe: Path, backend: Backend, made: list[tuple[int, int]],
           kind: type[ExpertWorker] = ExpertWorker
           ) -> Callable[[int, int], Awaitable[ExpertWorker]]:
    async def load(layer: int, expert: int) -> ExpertWorker:
        made.append((layer, expert))
        weights = load_weights(moe, backend, [f"blk.{layer}.{s}" for s in EXPERT_SUFFIXES],
                               {layer: (expert, expert + 1)})
        return kind(weights, backend)
    return load


async def test_the_cache_follows_the_routing_and_keeps_an_expert_while_it_computes(
        moe: Path) -> None:
    backend, made = Backend(1), []
    hot = HotExperts(loader(moe, backend, made), capacity=2, after=4)
    try:
        for _ in range(3):  # not yet planned: nothing is loaded
            await hot.observe(0, np.array([[1, 2]]))
        assert hot.planned == [] and not hot.workers
        for _ in range(3):  # planned after 4 rows; one expert loaded per call
            await hot.observe(0, np.array([[1, 2]]))
        assert set(hot.workers) == {(0, 1), (0, 2)} and made == [(0, 1), (0, 2)]
        with hot.using((0, 1)):  # a computation on (0, 1) is under way
            for _ in range(300):  # the routing moves to other experts and layers
                await hot.observe(3, np.array([[5, 6]]))
            assert (0, 1) in hot.workers and (0, 2) not in hot.workers
        await hot.observe(3, np.array([[5, 6]]))
        assert set(hot.workers) == {(3, 5), (3, 6)}
    finally:
        hot.close()
        backend.close()
    assert not hot.workers


async def test_an_expert_that_failed_to_load_is_tried_again_after_the_retry_wait(
        moe: Path) -> None:
    backend, made, fail, clock = Backend(1), [], [True], Clock()
    real = loader(moe, backend, made)

    async def flaky(layer: int, expert: int) -> ExpertWorker:
        if fail[0]:
            made.append((layer, expert))
            raise OSError("no holder answered")
        return await real(layer, expert)

    hot = HotExperts(flaky, capacity=1, after=1, clock=clock)
    try:
        await hot.observe(0, np.array([[3, 3]]))
        await hot.observe(0, np.array([[3, 3]]))
        assert made == [(0, 3)] and not hot.workers  # failed once, not again at once
        fail[0] = False
        clock.now += HOT_RETRY_S - 1
        await hot.observe(0, np.array([[3, 3]]))
        assert made == [(0, 3)] and not hot.workers  # nor within the wait
        clock.now += 1
        await hot.observe(0, np.array([[3, 3]]))
        assert made == [(0, 3), (0, 3)] and set(hot.workers) == {(0, 3)}
    finally:
        hot.close()
        backend.close()


async def test_cached_experts_compute_while_the_remote_request_is_out(
        moe: Path, worker: Served, tmp_path: Path) -> None:
    """A row needing a cached expert and a remote one: the request goes first and the
    cached expert computes meanwhile (in place, it would hold the loop: the request could
    not go out, and the round trip would come on top of the local compute)."""
    from kvasird.identity import load_node_key
    from kvasird.inference.client.routing import Fitness, Latency, PeerHoldings
    from kvasird.inference.protocol import EXPERT_PROTOCOL
    from kvasird.inference.protocol.delegation import Issuer
    from kvasird.inference.transport.channel import Channels, serve

    from .test_channel import pair

    asked, waiting = threading.Event(), [True]
    seen: list[bool] = []

    class Waiting(ExpertWorker):
        def __call__(self, layer: int, cur: np.ndarray, sel: np.ndarray) -> np.ndarray:
            if waiting[0]:
                seen.append(asked.wait(5))  # the worker got its request while we compute
            return super().__call__(layer, cur, sel)

    backend, made = Backend(1), []
    hot = HotExperts(loader(moe, backend, made, Waiting), capacity=2, after=1)
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((1, worker.hp.n_embd)).astype(np.float32)
    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        server = expert_server(worker)

        async def handle(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
            asked.set()
            return await server.handle(caller, msg)

        b.set_stream_handler(EXPERT_PROTOCOL, lambda s: serve(s, handle, 10))
        channels = Channels(a, lanes=False)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        holders = [PeerHoldings(peer, False, (), tuple((lay, 0, N_EXPERT)
                                                       for lay in range(N_LAYER)))]
        me = Issuer(load_node_key(tmp_path / "0.key").keypair, NETWORK)
        dispatcher = ExpertDispatcher(
            me, lambda: holders, channels, Latency(me.peer_id, lambda p: 1.0),
            Fitness(60), lambda layer, expert: None, timeout_s=10, wire_dtype="f32", spot_check=0,
            tolerance=0.01, hot=hot)
        try:
            ids = np.array([[1, 6]])
            out = await dispatcher.compute(2, 0, N_EXPERT, rows, ids)
            assert made == [(2, 1)] and seen == [True]
            assert dispatcher.stats["hot_rows"] == 1 and dispatcher.stats["calls"] == 1
            assert np.allclose(out, worker.run_of(2, 0).worker(2, rows, ids), atol=1e-5)
            # the second call caches the other expert too: no request at all
            waiting[0] = False
            asked.clear()
            out = await dispatcher.compute(2, 0, N_EXPERT, rows, ids)
            assert made == [(2, 1), (2, 6)] and dispatcher.stats["hot_rows"] == 3
            assert dispatcher.stats["calls"] == 1 and not asked.is_set()
            assert np.allclose(out, worker.run_of(2, 0).worker(2, rows, ids), atol=1e-5)
        finally:
            nursery.cancel_scope.cancel()
            hot.close()
            backend.close()

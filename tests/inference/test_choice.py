"""ExpertChoice: a fallback replica's layer goes to the workers only where they are faster,
by what was measured; a stale measurement gives way to the heartbeat's estimate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvasird.compute.experts import ExpertShard, ExpertWorker
from kvasird.compute.stage import Stage
from kvasird.inference.client.choice import FRESH_S, PROBE_EVERY, ExpertChoice, bucket
from kvasird.inference.client.routing import Fitness, Latency, PeerHoldings

from .conftest import N_EXPERT, N_LAYER

ME, W1, W2 = "me", "worker-1", "worker-2"


@pytest.fixture(scope="module")
def stage(moe: Path) -> Iterator[Stage]:
    st = Stage.load(moe, (0, N_LAYER), threads=1)  # every expert loaded: a fallback replica
    yield st
    st.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chooser(
    mode: str = "auto", rtt: float | None = 50.0, halves: bool = True
) -> tuple[ExpertChoice, Clock]:
    """Two workers with half of every layer's experts each (or one with all of them)."""
    half = N_EXPERT // 2
    holders = [
        PeerHoldings(
            W1, False, (), tuple((lay, 0, half if halves else N_EXPERT) for lay in range(N_LAYER))
        ),
        PeerHoldings(W2, False, (), tuple((lay, half, N_EXPERT) for lay in range(N_LAYER))),
    ]
    clock = Clock()
    choice = ExpertChoice(
        ME, lambda: holders, Latency(ME, lambda p: rtt), Fitness(60.0), mode, clock
    )
    return choice, clock


def test_a_far_worker_never_takes_a_layer_and_our_copy_is_counted(stage: Stage) -> None:
    choice, _ = chooser(rtt=40.0)  # a WAN link: 40 ms round trips
    layers = tuple(range(N_LAYER))
    assert choice(stage, layers, 1) == frozenset()
    assert choice(stage, layers, 16) == frozenset()
    assert {lay: dict(c) for lay, c in choice.counts.items()} == {
        lay: {"fallback": 2} for lay in layers
    }
    ours, theirs = choice.estimates(stage, 0, 1)
    assert 0 < ours < 40.0 and theirs is not None and theirs >= 40.0


def test_workers_measured_faster_than_our_copy_take_the_layer_until_they_slow_down(
    stage: Stage,
) -> None:
    choice, clock = chooser(rtt=None)
    ours, _ = choice.estimates(stage, 1, 1)
    for worker in (W1, W2):  # both answered a row in a tenth of our compute
        choice.observed(worker, 1, ours / 10)
    assert choice(stage, (1,), 1) == frozenset({1})
    choice.observed(W2, 1, 100 * ours)  # one piece slow: the layer waits for both
    choice.observed(W2, 1, 100 * ours)
    assert choice(stage, (1,), 1) == frozenset()
    # another row count is measured apart: nothing answered 8 rows yet, and without a
    # heartbeat round trip a worker counts as far (routing's default latency)
    assert bucket(5) == 8
    assert choice(stage, (1,), 5) == frozenset()


def test_a_stale_measurement_gives_way_to_the_heartbeat_estimate(stage: Stage) -> None:
    choice, clock = chooser(rtt=0.0)  # a link of no delay: our share of compute decides
    ours, _ = choice.estimates(stage, 2, 1)
    for worker in (W1, W2):
        choice.observed(worker, 1, 50 * ours)  # measured slow
    assert choice(stage, (2,), 1) == frozenset()
    clock.now += FRESH_S + 1  # the measurement is stale: the estimate is half our compute
    assert choice(stage, (2,), 1) == frozenset({2})


def test_modes_override_the_measurement(stage: Stage) -> None:
    remote, _ = chooser("remote", rtt=40.0)
    assert remote(stage, (0, 1), 1) == frozenset({0, 1})
    fallback, _ = chooser("fallback", rtt=0.0)
    for worker in (W1, W2):
        fallback.observed(worker, 1, 0.0)
    assert fallback(stage, (0, 1), 1) == frozenset()
    nobody, _ = chooser("remote")
    nobody.holders = lambda: []  # no peer serves the experts: our copy computes them
    assert nobody(stage, (0,), 1) == frozenset()
    with pytest.raises(ValueError, match="expert choice"):
        chooser("sometimes")


def test_our_compute_is_timed_again_after_a_while(stage: Stage) -> None:
    choice, _ = chooser()
    choice.estimates(stage, 0, 1)
    key = next(iter(choice._ours))
    first = choice._ours[key][0]
    choice._ours[key] = (first, PROBE_EVERY)  # as after PROBE_EVERY choices
    choice.estimates(stage, 0, 1)
    assert choice._ours[key][1] == 0 and choice._ours[key][0] > 0


def test_layers_sent_out_compute_what_the_one_graph_does(stage: Stage) -> None:
    """A step whose layers the choice sends out ends its graphs at their routers: the
    logits are the one graph's to float rounding."""
    worker = ExpertWorker(stage.weights, stage.backend)
    calls: list[int] = []

    def remote(layer: int, rows: np.ndarray, sel: np.ndarray) -> np.ndarray:
        calls.append(layer)
        return worker(layer, rows, sel)

    for layer in range(N_LAYER):
        stage.offer(layer, [ExpertShard(0, N_EXPERT, remote)])
    tokens = np.array([1, 2, 3, 4], np.int32)
    fused = stage.forward(stage.open_session(), tokens, logits="all")
    stage.choose = lambda st, layers, rows: frozenset(layers)
    try:
        chosen = stage.choose_experts(len(tokens))
        assert chosen == frozenset(range(N_LAYER)) and not stage.dispatches
        split = stage.forward(stage.open_session(), tokens, logits="all", remote=chosen)
    finally:
        stage.choose = None
        stage.optional.clear()
        worker.close()
    assert sorted(set(calls)) == list(range(N_LAYER))
    np.testing.assert_allclose(split, fused, rtol=1e-4, atol=1e-4)

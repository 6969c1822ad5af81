"""Embeddings through a route (SwarmGenerator.embed), in process: every position's hidden
state after the final norm, as one stage holding the whole model computes it, the work
counted to the hops that did it, a failed hop replaced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage
from kvasird.config import InferenceConfig
from kvasird.inference.api import EmbeddingRequest, ModelInfo
from kvasird.inference.client.routing import Fitness, Latency
from kvasird.inference.client.swarm import SwarmGenerator

from .conftest import N_LAYER, PROMPT
from .fakenet import FakeNet

INPUTS = (tuple(PROMPT), (9, 8, 7), tuple(range(1, 200)))


@pytest.fixture(scope="module")
def expected(model: Path) -> list[np.ndarray]:
    full = Stage.load(model, threads=1, kv=KVSpec(n_slots=512))  # f16, as the stages
    try:
        return [full.forward(full.open_session(), np.asarray(ids), 0, "embd") for ids in INPUTS]
    finally:
        full.close()



def generator(net: FakeNet) -> SwarmGenerator:
    return SwarmGenerator(
        net.me, lambda: ModelInfo("m", "test", 512), lambda: N_LAYER, net.holders,
        net, net.servers[net.me].handle,  # type: ignore[arg-type]
        Latency(net.me, lambda p: {"b": 1.0, "b2": 5.0}.get(p, 1.0)), Fitness(300),
        InferenceConfig(), net.inbox)


async def test_a_route_embeds_as_the_whole_model_does_and_counts_each_hops_work(
        net: FakeNet, expected: list[np.ndarray]) -> None:
    gen = generator(net)
    async with net.running() as nursery:
        gen.nursery = nursery
        rows = await gen.embed(EmbeddingRequest("m", INPUTS, "e1"))
    for got, want in zip(rows, expected, strict=True):
        assert got.shape == want.shape and np.allclose(got, want, rtol=1e-5, atol=1e-5)
    work = {w.peer: w.units for w in gen.work("e1")}
    n = sum(len(ids) for ids in INPUTS)
    # gw: layer 0 and the head; b: layers 1-2; c: layer 3
    assert work == {"gw": 2 * n, "b": 2 * n, "c": n}
    assert all(s.sessions == {} for s in net.servers.values())


async def test_an_embedding_whose_hop_dies_is_computed_again_on_its_replica(
        net: FakeNet, expected: list[np.ndarray]) -> None:
    gen = generator(net)
    net.down.add("b")
    async with net.running() as nursery:
        gen.nursery = nursery
        rows = await gen.embed(EmbeddingRequest("m", INPUTS[:1], "e2"))
    assert np.allclose(rows[0], expected[0], rtol=1e-5, atol=1e-5)
    assert "b2" in {w.peer for w in gen.work("e2")}


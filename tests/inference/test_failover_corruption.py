"""A stage whose slice is corrupt computes NaN: it refuses its own output (or, when it does
not check it, the stage it sends it to refuses it and names it), so the gateway avoids it
(not the healthy neighbour its output would have reached) and the generation goes on
through a replica."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage, generate
from kvasird.config import InferenceConfig
from kvasird.inference.api import GenerationError
from kvasird.inference.client.routing import Fitness
from kvasird.inference.client.swarm import SwarmGenerator
from kvasird.inference.errors import Refusal
from kvasird.inference.protocol.stage import Open, Step
from kvasird.inference.server.engine import Holdings, Served
from kvasird.model.gguffile import read_header
from kvasird_dev.testmodels import make_model

from .conftest import N_LAYER, PROMPT
from .fakenet import FakeNet, no_experts
from .test_swarm import generator, run

CORRUPT = "blk.2.ffn_down.weight"
"""A tensor of b's window (layers 1-3): NaN in its stored bytes."""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The model, and a copy whose CORRUPT tensor holds NaN (f32, so byte for byte)."""
    root = tmp_path_factory.mktemp("m")
    good = make_model(root / "dense.gguf", arch="llama", n_layer=N_LAYER, dtype="f32")
    bad = root / "corrupt.gguf"
    shutil.copyfile(good, bad)
    header = read_header(bad)
    t = next(t for t in header.tensors if t.name == CORRUPT)
    with bad.open("r+b") as f:
        f.seek(header.data_offset + t.offset)
        f.write(np.full(t.length // 4, np.nan, "<f4").tobytes())
    return good, bad


@pytest.fixture(scope="module")
def served(models: tuple[Path, Path]) -> Iterator[dict[str, Served]]:
    """gw: head + layer 0; b (corrupt) and its replica b2: layers 1-2; c: layer 3."""
    good, bad = models
    parts = {"gw": (good, Holdings(head=True, windows=((0, 1),))),
             "b": (bad, Holdings(windows=((1, 3),))), "b2": (good, Holdings(windows=((1, 3),))),
             "c": (good, Holdings(windows=((3, 4),)))}
    out = {name: Served.build([path], h, threads=1, kv_slots=256, remote=no_experts)
           for name, (path, h) in parts.items()}
    yield out
    for s in out.values():
        s.close()


@pytest.fixture(scope="module")
def reference(models: tuple[Path, Path]) -> list[int]:
    full = Stage.load(models[0], threads=1, kv=KVSpec(n_slots=256, dtype="f32"))
    try:
        return generate(full, PROMPT, 10)
    finally:
        full.close()


def _gateway(net: FakeNet, fitness: Fitness) -> SwarmGenerator:
    gen = generator(net, fitness)  # b is nearer than b2: routed to first
    gen.config = InferenceConfig(step_timeout_s=3.0)  # the old way waited this out
    return gen


async def test_the_corrupt_stage_is_avoided_and_a_replica_completes_the_generation(
        served: dict[str, Served], reference: list[int]) -> None:
    net, fitness = FakeNet(served), Fitness(300)
    with trio.fail_after(60):
        assert await run(_gateway(net, fitness), 10) == reference
    assert set(fitness.snapshot()) == {"b"}
    assert "broken" in fitness.snapshot()["b"] and "NaN" in fitness.snapshot()["b"]


async def test_without_a_replica_the_corrupt_stage_is_blamed_not_its_neighbour(
        served: dict[str, Served]) -> None:
    net, fitness = FakeNet({k: v for k, v in served.items() if k != "b2"}), Fitness(300)
    with trio.fail_after(60), pytest.raises(GenerationError):
        await run(_gateway(net, fitness), 10)
    assert set(fitness.snapshot()) == {"b"}


async def test_a_stage_refuses_its_own_non_finite_output_as_broken(
        served: dict[str, Served]) -> None:
    net = FakeNet(served)
    b = net.servers["b"]
    await b.handle("gw", Open("s", "m", 1, 3, False, False, 16).to_wire())
    rows = np.ones((2, served["b"].hp.n_embd), np.float32)
    with pytest.raises(Refusal) as refused:
        await b.handle("gw", Step("s", 0, rows, "f32").to_wire())
    assert refused.value.code == "broken" and "layers [1, 3)" in refused.value.detail
    healthy = net.servers["b2"]
    await healthy.handle("gw", Open("s", "m", 1, 3, False, False, 16).to_wire())
    assert "x" in await healthy.handle("gw", Step("s", 0, rows, "f32").to_wire())


async def test_a_stage_that_sends_nan_unchecked_is_blamed_by_its_receiver(
        served: dict[str, Served], reference: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """b does not check its own output (a faulty build, or a peer that read the code): its
    receiver refuses the NaN rows as input and names b (here the gateway, through which the
    first prompt chunk is relayed for spot checks; on a forwarded step, c), the gateway
    avoids b and not c, and the replica b2 completes the generation as an undisturbed run
    does."""
    net, fitness = FakeNet(served), Fitness(300)
    monkeypatch.setattr(net.servers["b"], "_check_finite", lambda *args: None)
    with trio.fail_after(60):
        assert await run(_gateway(net, fitness), 10) == reference
    assert set(fitness.snapshot()) == {"b"}
    assert "NaN" in fitness.snapshot()["b"]
    assert ("b", "c", "step") not in net.sent  # the gateway refused it before c saw it

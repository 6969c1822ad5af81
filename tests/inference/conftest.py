"""Fixtures of the in-process inference tests: a small dense model and its undisturbed tokens,
a small MoE model and a worker holding all its experts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvasird.compute.experts import ExpertShard
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage, generate
from kvasird.inference.server.engine import Holdings, Served
from kvasird_dev.testmodels import make_model

from .fakenet import FakeNet, no_experts

N_LAYER = 4
N_EXPERT = 8
PROMPT = [3, 1, 4, 1, 5, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "dense.gguf", arch="llama",
                      n_layer=N_LAYER, dtype="f32")


@pytest.fixture(scope="module")
def reference(model: Path) -> list[int]:
    """Greedy tokens of PROMPT on one stage holding the whole model."""
    full = Stage.load(model, threads=1, kv=KVSpec(n_slots=256, dtype="f32"))
    try:
        return generate(full, PROMPT, 10)
    finally:
        full.close()


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[dict[str, Served]]:
    """gw: head + layers 0-1; b and b2: layers 1-3 (replicas); c: layer 3."""
    parts = {"gw": Holdings(head=True, windows=((0, 1),)), "b": Holdings(windows=((1, 3),)),
             "b2": Holdings(windows=((1, 3),)), "c": Holdings(windows=((3, 4),))}
    out = {name: Served.build([model], h, threads=1, kv_slots=256, remote=no_experts)
           for name, h in parts.items()}
    yield out
    for s in out.values():
        s.close()


def no_remote(layer: int, first: int, end: int) -> ExpertShard:
    """The expert dispatcher of a node holding every expert: never called."""
    raise AssertionError("this node holds everything it computes")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "moe.gguf", n_layer=N_LAYER,
                      n_expert=N_EXPERT, n_expert_used=2, dtype="f32")


@pytest.fixture(scope="module")
def worker(moe: Path) -> Iterator[Served]:
    """A worker-only node holding every expert of every layer."""
    every = Holdings(experts=tuple((lay, 0, N_EXPERT) for lay in range(N_LAYER)))
    served = Served.build([moe], every, threads=1, kv_slots=256, remote=no_remote)
    yield served
    served.close()


@pytest.fixture
def net(served: dict[str, Served]) -> Iterator[FakeNet]:
    """Every peer of `served` on one in-process network, gw the gateway; their sessions
    freed after the test."""
    net = FakeNet(dict(served))
    yield net
    for server in net.servers.values():
        server.close_all()

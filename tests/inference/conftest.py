"""Fixtures of the in-process gateway tests: a small dense model and its undisturbed tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvasird.compute.kvcache import KVSpec
from kvasird.compute.stage import Stage, generate
from kvasird.model.testmodels import make_model

N_LAYER = 4
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

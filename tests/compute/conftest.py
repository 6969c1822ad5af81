"""Generated models shared by the compute tests (written once per session, a few MB each)."""

from __future__ import annotations

import pytest

from kvasird.compute.kvcache import KVSpec
from kvasird.compute.stage import Stage
from kvasird.model.bundled import bundled_path
from kvasird.model.testmodels import make_model


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {
        "moe": make_model(d / "moe.gguf", n_layer=3, n_expert=8, n_expert_used=2, seed=1),
        "moe_q8": make_model(d / "moe_q8.gguf", n_layer=2, dtype="q8_0", seed=2),
        "moe_q4k": make_model(d / "moe_q4k.gguf", n_layer=2, n_embd=256, head_dim=64,
                              n_ff_exp=256, dtype="q4_k", tied_output=True, seed=3),
        "llama": make_model(d / "llama.gguf", arch="llama", n_layer=3, seed=4),
    }


@pytest.fixture(scope="session")
def bundled():
    return bundled_path()


@pytest.fixture(scope="session")
def bundled_stage(bundled):
    stage = Stage.load(bundled, threads=2, kv=KVSpec(n_slots=512, dtype="f32"))
    yield stage
    stage.close()

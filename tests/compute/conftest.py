"""Generated models shared by the compute tests (written once per session, a few MB each)."""

from __future__ import annotations

import pytest

from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage
from kvasird.model.bundled import bundled_path
from kvasird_dev.testmodels import make_model


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
def arch_models(tmp_path_factory):
    """qwen3, llama with experts ("mixtral"), gemma3, qwen35, qwen35moe and gpt-oss, 3
    layers, f32 and Q8_0 (and gpt-oss with MXFP4 experts, as its files ship them, the rest
    Q8_0: "mxfp4"): {(arch, dtype): path}. gemma3's and gpt-oss's layers 0 and 2 have a
    4-position sliding window; the qwen35 family's layers 0 and 2 are delta-nets, layer 1
    attends.

    Q8_0 seeds are ones where no activation lies on a Q8_0 rounding tie between float32
    and float64 math (seed 5 of qwen3 has one: a quantized step flips at layer 1; so do
    seeds 8 and 11 of qwen35)."""
    d = tmp_path_factory.mktemp("arch_models")
    seeds = {("qwen3", "f32"): 3, ("qwen3", "q8_0"): 1, ("mixtral", "f32"): 4,
             ("mixtral", "q8_0"): 2, ("gemma3", "f32"): 5, ("gemma3", "q8_0"): 6,
             ("qwen35", "f32"): 7, ("qwen35", "q8_0"): 12, ("qwen35moe", "f32"): 9,
             ("qwen35moe", "q8_0"): 10, ("gpt-oss", "f32"): 13, ("gpt-oss", "q8_0"): 14,
             ("gpt-oss", "mxfp4"): 15}
    return {(a, t): make_model(d / f"{a}_{t}.gguf", arch=a, n_layer=3, seed=seed,
                               **({"dtype": "q8_0", "expert_dtype": t} if t == "mxfp4" else
                                  {"dtype": t}))
            for (a, t), seed in seeds.items()}


@pytest.fixture(scope="session")
def bundled():
    return bundled_path()


@pytest.fixture(scope="session")
def bundled_stage(bundled):
    stage = Stage.load(bundled, threads=2, kv=KVSpec(n_slots=512, dtype="f32"))
    yield stage
    stage.close()

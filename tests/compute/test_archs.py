"""qwen3, llama with experts (Mixtral) and gemma3 end to end: the engine against the
float64 oracle, a model split in ring windows and expert ranges against one node holding
it all, sliding windows, and how the registry tells llama's two layouts apart."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from kvasird.compute import arch as archs
from kvasird.compute.errors import WeightsError
from kvasird.compute.experts import ExpertWorker
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.graph import Backend
from kvasird.compute.hparams import HParams
from kvasird.compute.kvcache import KVSpec
from kvasird.compute.stage import Stage
from kvasird.compute.weights import load_weights
from kvasird.numerics.contract import VerifyPlan, verify
from kvasird.numerics.metrics import compare
from kvasird.numerics.oracle import Features, Oracle

EXACT_KV = KVSpec(n_slots=512, dtype="f32")
"""F32 KV: the engine then differs from the float64 oracle only by float32 rounding."""

PROMPT = np.array([1, 504, 3458, 314, 4649, 282, 4649, 30, 7000, 12])
NEW = ["qwen3", "mixtral", "gemma3"]
BOTH = [(a, t) for a in NEW for t in ("f32", "q8_0")]
EXPS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
WINDOWS = [(0, 1), (1, 2), (2, 3)]


def all_logits(stage: Stage, prompt: np.ndarray = PROMPT) -> np.ndarray:
    with stage.open_session() as s:
        return stage.forward(s, prompt, logits="all")


def f32_oracle(path) -> Oracle:
    """The oracle an F32 model matches to float32 rounding: exact math, except that
    ggml's GELU is a float16 table lookup (gemma), which only the rounding oracle does."""
    exact = Oracle(path)
    return Oracle(path, emulate=True) if exact.features.geglu else exact


@pytest.mark.parametrize("arch, dtype", BOTH)
def test_logits_match_the_oracle(arch_models, arch, dtype):
    """F32 to float32 rounding; Q8_0 to float32 rounding of an oracle that rounds
    activations as ggml does, and far closer to it than to exact math."""
    path = arch_models[arch, dtype]
    stage = Stage.load(path, threads=1, kv=EXACT_KV)
    got = all_logits(stage)
    stage.close()
    exact = compare(got, Oracle(path).logits(PROMPT))
    if dtype == "f32":
        m = compare(got, f32_oracle(path).logits(PROMPT))
        assert m.rel_linf < 1e-5 and m.top1 == 1.0 and exact.cosine > 0.99999
        return
    rounded = compare(got, Oracle(path, emulate=True).logits(PROMPT))
    assert rounded.rel_l2 < 1e-5 and rounded.top1 == 1.0
    assert exact.rel_l2 > 10 * rounded.rel_l2 and exact.cosine > 0.9995


@pytest.mark.parametrize("arch", NEW)
def test_each_f32_layer_matches_the_oracle(arch_models, arch):
    path = arch_models[arch, "f32"]
    hidden = f32_oracle(path).hidden(PROMPT)
    for k in range(1, 4):
        stage = Stage.load(path, (0, k), head=False, threads=1, kv=EXACT_KV)
        with stage.open_session() as s:
            got = stage.forward(s, PROMPT)
        stage.close()
        assert compare(got, hidden[k]).rel_linf < 1e-5, f"layer {k - 1}"


@pytest.mark.parametrize("arch", NEW)
def test_decode_steps_match_one_prefill(arch_models, arch):
    stage = Stage.load(arch_models[arch, "f32"], threads=1, kv=EXACT_KV)
    with stage.open_session() as a, stage.open_session() as b:
        want = stage.forward(a, PROMPT, logits="all")
        stage.forward(b, PROMPT[:4])
        steps = [stage.forward(b, PROMPT[i:i + 1])[0] for i in range(4, len(PROMPT))]
    stage.close()
    assert compare(np.array(steps), want[4:]).rel_linf < 1e-5


def chain(stages: list[Stage], prompt: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefill logits (all positions) and one decode step's, through stages in order."""
    sessions = [s.open_session() for s in stages]
    try:
        outs = []
        for x, mode in ((prompt, "all"), (np.array([step]), "last")):
            for stage, session in zip(stages, sessions, strict=True):
                x = stage.forward(session, x, logits=mode) if stage.head else \
                    stage.forward(session, x)
            outs.append(x)
        return outs[0], outs[1]
    finally:
        for s in sessions:
            s.close()


@pytest.mark.parametrize("arch, dtype", BOTH)
def test_three_ring_windows_equal_one_node(arch_models, arch, dtype):
    path = arch_models[arch, dtype]
    whole = Stage.load(path, threads=1, kv=EXACT_KV)
    ring = [Stage.load(path, w, threads=1, kv=EXACT_KV) for w in WINDOWS]
    assert ring[0].embed and ring[-1].head and not any(s.head for s in ring[:-1])
    want, got = chain([whole], PROMPT, 42), chain(ring, PROMPT, 42)
    for s in (whole, *ring):
        s.close()
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@contextlib.contextmanager
def expert_workers(path, cuts: list[int]) -> Iterator[list[ExpertWorker]]:
    """One worker per expert range [cuts[i], cuts[i+1]) holding it for every layer."""
    backend = Backend(1)
    names = [f"blk.{layer}.{s}" for layer in range(3) for s in EXPS]
    workers = [ExpertWorker(load_weights(path, backend, names,
                                         {layer: (e0, e1) for layer in range(3)}), backend)
               for e0, e1 in zip(cuts, cuts[1:], strict=False)]
    try:
        yield workers
    finally:
        for w in workers:
            w.close()
            w.weights.close()
        backend.close()


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
@pytest.mark.parametrize("cuts", [[0, 4, 8], [0, 3, 6, 8], [0, 2, 4, 6, 8]])
def test_mixtral_experts_in_ranges_across_three_windows_equal_one_node(arch_models, dtype, cuts):
    """Each ring window holds only its layers' dense paths and routes to 2-4 workers of
    expert ranges; the combine runs in numpy rather than in the graph, so float rounding."""
    path = arch_models["mixtral", dtype]
    whole = Stage.load(path, threads=1, kv=EXACT_KV)
    with expert_workers(path, cuts) as workers:
        ring = [Stage.load(path, (a, b), threads=1, kv=EXACT_KV,
                           experts={a: [w.shard(a) for w in workers]}) for a, b in WINDOWS]
        assert all(len(s.segments) == 2 and s.dispatches for s in ring)
        assert not ring[0].weights.experts and len(whole.segments) == 1
        want, got = chain([whole], PROMPT, 77), chain(ring, PROMPT, 77)
        for s in (whole, *ring):
            s.close()
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max()
        assert (g.argmax(-1) == w.argmax(-1)).all()


def test_a_sliding_window_bounds_what_the_last_token_depends_on(tmp_path):
    """Every layer windowed (4 positions, 3 layers): the last of 12 tokens sees back 9
    positions, so the first two cannot change its logits; with one global layer they do."""
    from kvasird.model.testmodels import make_model

    def last_logits(path, prompt):
        stage = Stage.load(path, threads=1, kv=EXACT_KV)
        with stage.open_session() as s:
            out = stage.forward(s, prompt)[0]
        stage.close()
        return out

    prompt = np.concatenate([PROMPT, [5, 6]])
    other = prompt.copy()
    other[:2] = [900, 901]
    windowed = make_model(tmp_path / "w.gguf", arch="gemma3", n_layer=3, swa_pattern=0)
    assert HParams.from_gguf(GGUFFile(windowed)).swa_layers == (True, True, True)
    np.testing.assert_array_equal(last_logits(windowed, prompt), last_logits(windowed, other))
    assert compare(last_logits(windowed, prompt), Oracle(windowed, emulate=True).logits(
        prompt)[-1]).rel_linf < 1e-5
    mixed = make_model(tmp_path / "m.gguf", arch="gemma3", n_layer=3, swa_pattern=2)
    assert HParams.from_gguf(GGUFFile(mixed)).swa_layers == (True, False, True)
    assert np.abs(last_logits(mixed, prompt) - last_logits(mixed, other)).max() > 1e-3


def test_llama_with_experts_is_an_architecture_of_its_own(arch_models):
    dense, moe = archs.get("llama"), archs.get("llama", 8)
    assert (dense.name, dense.is_moe, dense.label) == ("llama", False, "llama")
    assert (moe.name, moe.is_moe, moe.label) == ("llama", True, "llama with experts")
    assert "ffn_gate_inp.weight" in moe.dense_tensors and moe.expert_tensors == EXPS
    assert "ffn_gate.weight" not in moe.dense_tensors
    hp = HParams.from_gguf(GGUFFile(arch_models["mixtral", "f32"]))
    assert archs.for_hparams(hp) is moe
    assert archs.for_hparams(HParams.from_gguf(GGUFFile(arch_models["qwen3", "f32"]))) \
        is archs.get("qwen3")
    assert set(archs.supported()) == {"llama", "llama with experts", "qwen3", "qwen3moe",
                                      "gemma3"}
    # without a count: the name's only layout, or the dense one (no expert_count key)
    assert archs.get("llama") is dense and archs.get("qwen3moe").is_moe


def test_mixtral_experts_are_as_wide_as_llama_feed_forward_length(arch_models):
    """llama.cpp sizes llama's expert tensors by feed_forward_length (no expert key)."""
    f = GGUFFile(arch_models["mixtral", "f32"])
    hp = HParams.from_gguf(f)
    assert "llama.expert_feed_forward_length" not in f.metadata
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff, hp.n_ff_exp) == (8, 2, 32, 32)
    assert list(f.tensors["blk.0.ffn_up_exps.weight"].ne) == [64, 32, 8]


@pytest.mark.parametrize("name, n_expert, says", [
    ("qwen3", 8, "'qwen3' with 8 experts is not supported"),
    ("qwen3moe", 0, "'qwen3moe' without experts is not supported"),
    ("gpt9", 0, "'gpt9' is not supported"),
])
def test_an_unsupported_layout_names_what_is_supported(name, n_expert, says):
    with pytest.raises(WeightsError, match=says) as err:
        archs.get(name, n_expert)
    assert "(supported: llama, llama with experts, qwen3, qwen3moe, gemma3)" in str(err.value)


def test_partial_rotary_is_refused_at_load(arch_models, tmp_path):
    """The engine rotates whole heads; a file rotating fewer dimensions is refused, not
    served wrongly."""
    data = bytearray(arch_models["mixtral", "f32"].read_bytes())
    key = b"llama.rope.dimension_count"
    at = data.index(key) + len(key)  # then the value's type (uint32 = 4) and the value
    assert struct.unpack_from("<II", data, at) == (4, 16)
    struct.pack_into("<I", data, at + 4, 8)
    path = tmp_path / "partial.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="RoPE over 8 of 16 head dimensions"):
        Stage.load(path, threads=1)


def test_oracle_computes_from_features(arch_models):
    assert Oracle(arch_models["qwen3", "f32"]).features == \
        Features(rope_neox=True, qk_norm=True, experts=False)
    assert Oracle(arch_models["mixtral", "q8_0"]).features == \
        Features(rope_neox=False, qk_norm=False, experts=True)
    assert Oracle(arch_models["gemma3", "f32"]).features == \
        Features(rope_neox=True, qk_norm=True, post_norms=True, geglu=True, embed_scale=True)


@pytest.mark.parametrize("arch", NEW)
def test_verify_passes(arch_models, arch):
    plan = VerifyPlan(prompts=2, prompt_len=8, greedy_prompts=1, greedy_tokens=4)
    verdict = verify(arch_models[arch, "f32"], threads=1, plan=plan)
    assert verdict.passed, [c for c in verdict.checks if not c.ok]
    assert verdict.logits.top1 == 1.0

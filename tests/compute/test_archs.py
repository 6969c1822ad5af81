"""qwen3, llama with experts (Mixtral), gemma3, the Qwen3.5 hybrids (qwen35, qwen35moe) and
gpt-oss end to end: the engine against the float64 oracle, a model split in ring windows and
expert ranges against one node holding it all, sliding windows, the delta-net's recurrent
state in sessions, and how the registry tells llama's two layouts apart."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from kvasird.compute import arch as archs
from kvasird.compute.errors import InputError, KVCacheFull, WeightsError
from kvasird.compute.experts import ExpertWorker
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.graph import Backend, ggml, ne_of
from kvasird.compute.hparams import HParams
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage
from kvasird.compute.weights import load_weights
from kvasird.numerics.contract import VerifyPlan, verify
from kvasird.numerics.metrics import compare
from kvasird.numerics.oracle import Features, Oracle

EXACT_KV = KVSpec(n_slots=512, dtype="f32")
"""F32 KV: the engine then differs from the float64 oracle only by float32 rounding."""

PROMPT = np.array([1, 504, 3458, 314, 4649, 282, 4649, 30, 7000, 12])
NEW = ["qwen3", "mixtral", "gemma3", "qwen35", "qwen35moe", "gpt-oss"]
BOTH = [(a, t) for a in NEW for t in ("f32", "q8_0")] + [("gpt-oss", "mxfp4")]
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
    """F32 to float32 rounding; Q8_0 (and MXFP4 experts) to float32 rounding of an oracle
    that rounds activations as ggml does, and far closer to it than to exact math (which
    4-bit experts leave further behind)."""
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
    assert exact.rel_l2 > 10 * rounded.rel_l2
    assert exact.cosine > (0.998 if dtype == "mxfp4" else 0.9995)


@pytest.mark.parametrize("arch", NEW)
def test_each_f32_layer_matches_the_oracle(arch_models, arch):
    path = arch_models[arch, "f32"]
    hidden = f32_oracle(path).hidden(PROMPT)
    for k in range(1, 4):
        stage = Stage.load(path, (0, k), head=False, threads=1, kv=EXACT_KV)
        with stage.open_session() as s:
            got = stage.forward(s, PROMPT)
        stage.close()
        # float32 rounding: gemma3's four norms a layer reach 1.5e-5 by layer 2 on some
        # machines (linf 4e-4 on values up to 26), 5e-6 on others
        assert compare(got, hidden[k]).rel_linf < 3e-5, f"layer {k - 1}"


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


@pytest.mark.slow
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
    names = [f"blk.{layer}.{s}" for layer in range(3) for s in EXPS]  # biases come along
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


@pytest.mark.slow
@pytest.mark.parametrize("arch, dtype", [(a, t) for a in ("mixtral", "qwen35moe", "gpt-oss")
                                         for t in ("f32", "q8_0")] + [("gpt-oss", "mxfp4")])
@pytest.mark.parametrize("cuts", [[0, 4, 8], [0, 3, 6, 8], [0, 2, 4, 6, 8]])
def test_experts_in_ranges_across_three_windows_equal_one_node(arch_models, arch, dtype, cuts):
    """Each ring window holds only its layers' dense paths (qwen35moe: delta-net layers in
    the first and last, with the shared expert; gpt-oss: its experts' biases go with them)
    and routes to 2-4 workers of expert ranges; the combine runs in numpy rather than in
    the graph, so float rounding."""
    path = arch_models[arch, dtype]
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
    from kvasird_dev.testmodels import make_model

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
                                      "gemma3", "qwen35", "qwen35moe", "gpt-oss"}
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
    assert ("(supported: llama, llama with experts, qwen3, qwen3moe, gemma3, qwen35, "
            "qwen35moe, gpt-oss)") in str(err.value)


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
    assert Oracle(arch_models["qwen35moe", "f32"]).features == \
        Features(rope_neox=True, qk_norm=True, experts=True, hybrid=True)
    assert Oracle(arch_models["gpt-oss", "f32"]).features == \
        Features(rope_neox=True, experts=True, oai_experts=True)


def test_gpt_oss_reads_its_windows_yarn_and_clamp_as_llamacpp(arch_models):
    """Even layers windowed (llama.cpp's default pattern 2), rotating with the model's own
    base and scale; YaRN from rope.scaling (factor 32 over 128 positions); SwiGLU clamped
    at 7. llama.cpp's YaRN magnitude cancels ggml's 1 + 0.1 ln 32 to float32 rounding."""
    hp = HParams.from_gguf(GGUFFile(arch_models["gpt-oss", "f32"]))
    assert (hp.swa_layers, hp.n_swa) == ((True, False, True), 4)
    assert (hp.rope_base_swa, hp.rope_scale_swa) == (hp.rope_base, hp.rope_scale)
    assert (hp.rope_scale, hp.yarn_ext, hp.rope_ctx) == (np.float32(1 / 32), 1.0, 128)
    assert abs(hp.yarn_attn * (1 + 0.1 * np.log(32)) - (1 + 0.1 * np.log(32))) < 1e-6
    assert hp.swiglu_limit == 7.0
    moe = archs.for_hparams(hp)
    assert "attn_sinks.weight" in moe.dense_tensors and "ffn_down_exps.bias" in moe.expert_tensors


def test_an_mxfp4_expert_range_is_a_byte_copy_of_its_slab(arch_models):
    """MXFP4 blocks (32 values: one E8M0 scale byte, 16 bytes of codes) never cross an
    expert's rows, so experts [3, 6) load as the file's bytes of those experts, biases too."""
    path = arch_models["gpt-oss", "mxfp4"]
    f = GGUFFile(path)
    backend = Backend(1)
    names = ["blk.0.ffn_up_exps.weight", "blk.0.ffn_up_exps.bias"]
    w = load_weights(path, backend, names, {0: (3, 6)})
    try:
        for name in names:
            info = f.info(name)
            slab = info.nbytes // info.ne[-1]
            t = w.get(name)
            got = np.empty(3 * slab, np.uint8)
            ggml.ggml_backend_tensor_get(t, got.ctypes.data, 0, got.nbytes)
            assert list(ne_of(t)) == [*info.ne[:-1], 3]
            np.testing.assert_array_equal(got, np.asarray(f.data(name))[3 * slab:6 * slab])
        assert f.info(names[0]).type == ggml.GGML_TYPE_MXFP4
    finally:
        w.close()
        backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW)
def test_verify_passes(arch_models, arch):
    plan = VerifyPlan(prompts=2, prompt_len=8, greedy_prompts=1, greedy_tokens=4)
    verdict = verify(arch_models[arch, "f32"], threads=1, plan=plan)
    assert verdict.passed, [c for c in verdict.checks if not c.ok]
    assert verdict.logits.top1 == 1.0


def test_qwen35_layers_alternate_as_full_attention_interval_says(arch_models):
    hp = HParams.from_gguf(GGUFFile(arch_models["qwen35moe", "f32"]))
    assert hp.recurrent_layers == (True, False, True)
    assert (hp.n_rot, hp.head_dim, hp.rope_sections) == (8, 16, (2, 1, 1, 0))
    assert (hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_head_dim, hp.n_ff_shexp) == (2, 4, 16, 32)
    moe = archs.for_hparams(hp)
    assert "ssm_a" in moe.layer_tensors(hp, 0) and "attn_qkv.weight" not in moe.layer_tensors(hp, 1)
    stage = Stage.load(arch_models["qwen35moe", "f32"], threads=1, kv=EXACT_KV)
    assert sorted(stage.kv.states.conv) == [0, 2] and sorted(stage.kv.k) == [1]
    stage.close()


@pytest.fixture
def hybrid_stage(arch_models):
    stage = Stage.load(arch_models["qwen35moe", "f32"], threads=1,
                       kv=KVSpec(n_slots=512, dtype="f32", state_slots=2))
    yield stage
    stage.close()


def test_interleaved_sessions_keep_their_own_recurrent_state(hybrid_stage):
    stage = hybrid_stage
    other = PROMPT[::-1].copy()

    def steps(a, b=None) -> np.ndarray:
        mine = [stage.forward(a, PROMPT[:3], logits="all")]
        for i in range(3, len(PROMPT)):
            if b is not None:
                stage.forward(b, other[i:i + 1])
            mine.append(stage.forward(a, PROMPT[i:i + 1]))
        return np.concatenate(mine)

    with stage.open_session() as a:
        alone = steps(a)
    with stage.open_session() as a, stage.open_session() as b:
        stage.forward(b, other[:3])
        together = steps(a, b)
        assert a.state != b.state
    np.testing.assert_array_equal(together, alone)


def test_a_replay_from_position_zero_rebuilds_the_state(hybrid_stage):
    """Failover replays the history as one prefill: the state starts again from zero."""
    stage = hybrid_stage
    with stage.open_session() as s:
        stage.forward(s, PROMPT[::-1].copy())
        again = stage.forward(s, PROMPT, start=0, logits="all")
        s.truncate(0)
        third = stage.forward(s, PROMPT, logits="all")
    np.testing.assert_array_equal(again, all_logits(stage))
    np.testing.assert_array_equal(third, again)


def test_a_recurrent_state_cannot_rewind(hybrid_stage):
    stage = hybrid_stage
    with stage.open_session() as s:
        stage.forward(s, PROMPT)
        with pytest.raises(InputError, match="replay the history from position 0"):
            stage.forward(s, PROMPT[5:6], start=5)
        with pytest.raises(InputError, match="replay the history from position 0"):
            s.truncate(4)
        assert s.n_past == len(PROMPT)


def test_state_slots_bound_the_sessions_and_come_back_on_close(hybrid_stage):
    stage = hybrid_stage
    a, b, c = (stage.open_session() for _ in range(3))
    stage.forward(a, PROMPT[:2])
    stage.forward(b, PROMPT[:2])
    assert stage.kv.free_states == 0
    with pytest.raises(KVCacheFull, match="recurrent-state slots"):
        stage.forward(c, PROMPT[:2])
    a.close()
    stage.forward(c, PROMPT[:2])
    b.close()
    c.close()
    assert stage.kv.free_states == 2


def test_a_prefill_longer_than_one_graph_carries_the_state_across_chunks(arch_models):
    """600 tokens run as two graphs (MAX_CHUNK): the state and the KV cross between them
    as between two requests."""
    stage = Stage.load(arch_models["qwen35", "f32"], threads=1,
                       kv=KVSpec(n_slots=1280, dtype="f32"))
    prompt = np.random.default_rng(0).integers(0, 49152, 600)
    with stage.open_session() as a, stage.open_session() as b:
        whole = stage.forward(a, prompt)
        stage.forward(b, prompt[:100])
        parts = stage.forward(b, prompt[100:])
    stage.close()
    assert compare(parts, whole).rel_linf < 1e-5


def test_a_prefill_runs_each_delta_net_once_over_the_whole_prompt(arch_models):
    """Not token by token: one gated-delta-net op per delta-net layer for all 10 tokens."""
    stage = Stage.load(arch_models["qwen35", "f32"], threads=1, kv=EXACT_KV)
    all_logits(stage)
    [(_, graph)] = stage.graphs.items()
    nodes = [ggml.ggml_graph_node(graph.graph, i).contents
             for i in range(ggml.ggml_graph_n_nodes(graph.graph))]
    stage.close()
    runs = [n for n in nodes if n.op == ggml.GGML_OP_GATED_DELTA_NET]
    assert len(runs) == 2 and all(n.src[2].contents.ne[2] == len(PROMPT) for n in runs)

"""Small GGUF models with random weights and real llama.cpp metadata, for tests and benchmarks.

No MoE model small enough for CI is published (STACK.md), so MoE paths are tested on
generated files. They carry the real architecture keys and tensor names of llama.cpp
(``qwen3moe``, ``qwen3``, ``llama``, ``gemma3``, ``mixtral``: a ``llama`` file with
experts, the Qwen3.5 hybrids ``qwen35`` and ``qwen35moe``: gated delta-net layers
between full-attention ones, and ``gpt-oss``: biased attention with sinks, alternating
sliding windows, YaRN, biased experts with the clamped SwiGLU) and the bundled SmolLM2
tokenizer, so llama.cpp itself loads them and vocab sizes match the bundled model. A
file is a pure function of its arguments: the same seed gives the same bytes.

Weight types: ``f32``, ``f16``, ``q8_0``, ``q4_0``, ``q4_1``, ``mxfp4`` and the K-quants
``q4_k``, ``q6_k`` (quantized by ggml's own ``ggml_quantize_chunk``, the kernels llama.cpp
uses), and ``q4_k_m``: llama.cpp's most used mix, Q4_K with Q6_K where its quantizer puts
more bits (the output matrix, and attn_v and ffn_down of the first and last eighth of the
layers and every third between), the type real files are published in. As llama.cpp's
quantizer does, norms and the MoE router stay F32, and so do biases and attention sinks;
the experts may have a type of their own (``expert_dtype``: gpt-oss's files ship them in
MXFP4). In q4_k and q6_k files the embedding and output matrices are Q8_0: a 49152-row
K-quant takes ggml most of a second, and a mixed-type file is a better test anyway.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, RopeScalingType
from gguf.constants import GGML_QUANT_SIZES

from kvasird.errors import ModelError
from kvasird.model import bundled

ARCHS = ("qwen3moe", "llama", "qwen3", "mixtral", "gemma3", "qwen35moe", "qwen35", "gpt-oss")
"""What the generator writes; "mixtral" is llama.cpp's "llama" with routed experts."""

DTYPES: dict[str, GGMLQuantizationType] = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "mxfp4": GGMLQuantizationType.MXFP4,
    "q4_k": GGMLQuantizationType.Q4_K,
    "q6_k": GGMLQuantizationType.Q6_K,
    "q4_k_m": GGMLQuantizationType.Q4_K,
}
"""``q4_k_m`` is llama.cpp's mix of that name (``_q4_k_m``); the type here is its base."""

_K_QUANTS = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K}


class TestModelError(ModelError):
    """The requested test model cannot be built (bad dimensions for the chosen type)."""

    __test__ = False  # not a pytest class despite the name


@dataclass(frozen=True)
class TestModelSpec:
    """Everything that determines a generated model's bytes."""

    __test__ = False

    arch: str = "qwen3moe"
    """A name of ARCHS: llama.cpp's architecture, or "mixtral" (written as "llama")."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_embd: int = 64
    """Hidden size (a multiple of 256 for K-quants, of 32 for other quants)."""
    n_head: int = 4
    """Attention (query) heads."""
    n_head_kv: int = 2
    """Key/value heads (grouped-query attention when fewer than n_head)."""
    head_dim: int = 16
    """Per-head size; the qwen3 family stores it as key_length/value_length."""
    n_ff: int = 128
    """Dense FFN size (llama, qwen3); qwen3moe records it as feed_forward_length only."""
    n_expert: int = 8
    """Experts per MoE layer (qwen3moe, mixtral)."""
    n_expert_used: int = 2
    """Experts each token is routed to (top-k)."""
    n_ff_exp: int = 32
    """Hidden size of one expert's FFN (mixtral writes it as feed_forward_length)."""
    distinct_experts: int = 0
    """qwen3moe, mixtral: draw only this many experts per matrix and repeat them (0: all
    distinct). For benchmark shapes: ggml's K-quantizer takes minutes per billion weights,
    and what an expert computes costs the same whatever its numbers."""
    dtype: str = "f32"
    """Type of the weight matrices, a key of DTYPES."""
    expert_dtype: str = ""
    """Type of the routed experts' matrices, a key of DTYPES ("": dtype)."""
    tied_output: bool | None = None
    """Omit `output` so the head reuses token_embd; None = the arch's usual (llama tied)."""
    rope_base: float = 10000.0
    """RoPE frequency base."""
    sliding_window: int = 4
    """gemma3, gpt-oss: how many positions back a sliding-window layer's query sees."""
    swa_pattern: int = 2
    """gemma3, gpt-oss: every swa_pattern-th layer attends globally, the others through the
    window (gpt-oss writes it only when it is not llama.cpp's default, 2)."""
    yarn_factor: float = 32.0
    """gpt-oss: YaRN's rope.scaling.factor, over an original context of context_length /
    yarn_factor (as released files: 131072 = 32 x 4096)."""
    rope_base_swa: float = 1000.0
    """gemma3: RoPE base of the sliding-window layers."""
    logit_softcap: float = 0.0
    """gemma3: final logits soft-capped at this value (0: not capped)."""
    full_attention_interval: int = 2
    """qwen35*: every full_attention_interval-th layer attends, the others are delta-nets."""
    n_rot: int = 8
    """qwen35*: head dimensions RoPE rotates (partial rotary), in sections [n_rot/4, n_rot/8,
    n_rot/8, 0] pairs."""
    ssm_conv: int = 4
    """qwen35*: width of the delta-net's causal convolution."""
    ssm_head_dim: int = 16
    """qwen35*: size of a delta-net key or value head."""
    ssm_k_heads: int = 2
    """qwen35*: delta-net key heads."""
    ssm_v_heads: int = 4
    """qwen35*: delta-net value heads (a multiple of the key heads)."""
    n_ff_shexp: int = 32
    """qwen35moe: hidden size of the shared expert."""
    rms_eps: float = 1e-6
    """RMS-norm epsilon."""
    context_length: int = 4096
    """Trained context recorded in the metadata."""
    seed: int = 0
    """Seed of every random weight."""
    name: str = field(default="", compare=False)
    """general.name; derived from the other fields when empty."""

    @property
    def tied(self) -> bool:
        if self.tied_output is None:
            return self.arch in ("llama", "gemma3")
        return self.tied_output

    @property
    def gguf_arch(self) -> str:
        """`general.architecture` of the file."""
        return "llama" if self.arch == "mixtral" else self.arch

    @property
    def routed(self) -> bool:
        """Layers have routed experts instead of a dense FFN."""
        return self.arch in ("qwen3moe", "mixtral", "qwen35moe", "gpt-oss")

    @property
    def qk_norm(self) -> bool:
        """Layers hold per-head Q/K norms."""
        return self.arch in ("qwen3moe", "qwen3", "gemma3", "qwen35moe", "qwen35")

    @property
    def hybrid(self) -> bool:
        """Gated delta-net layers between full-attention ones (Qwen3.5)."""
        return self.arch in ("qwen35moe", "qwen35")

    def recurrent(self, layer: int) -> bool:
        """Whether `layer` is a delta-net (llama.cpp's rule for full_attention_interval)."""
        return self.hybrid and (layer + 1) % self.full_attention_interval != 0


def make_model(path: str | Path, arch: str = "qwen3moe", **dims: Any) -> Path:
    """Write a random-weight GGUF for `arch` at `path` and return the path.

    Keyword arguments are TestModelSpec fields (n_layer, n_embd, n_expert, dtype, seed...).
    """
    return write_model(Path(path), TestModelSpec(arch=arch, **dims))


def write_model(path: Path, spec: TestModelSpec) -> Path:
    """Write `spec` as a GGUF file; deterministic for a spec."""
    _check(spec)
    tok = bundled_tokenizer()
    n_vocab = len(tok["tokenizer.ggml.tokens"][2])
    writer = GGUFWriter(str(path), spec.gguf_arch)
    _write_metadata(writer, spec, n_vocab)
    for key, (vtype, sub, value) in tok.items():
        writer.add_key_value(key, value, GGUFValueType(vtype), GGUFValueType(sub) if sub else None)
    rng = np.random.default_rng(spec.seed)
    for name, data, qtype in _tensors(spec, n_vocab, rng):
        _add_tensor(writer, name, data, _q4_k_m(spec, name, qtype) if spec.dtype == "q4_k_m"
                    else qtype)
    return save(writer, path)


def _q4_k_m(spec: TestModelSpec, name: str, qtype: GGMLQuantizationType
            ) -> GGMLQuantizationType:
    """The type llama.cpp's Q4_K_M gives a tensor (without an importance matrix)."""
    if qtype == GGMLQuantizationType.F32:
        return qtype  # norms, router, biases, sinks
    if name == "output.weight" or (name == "token_embd.weight" and spec.tied):
        return GGMLQuantizationType.Q6_K
    if name == "token_embd.weight":
        return GGMLQuantizationType.Q4_K
    kind = name.split(".")[2]
    i, n = int(name.split(".")[1]), spec.n_layer
    more_bits = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
    if kind in ("attn_v", "ffn_down", "ffn_down_exps") and more_bits:
        return GGMLQuantizationType.Q6_K
    return GGMLQuantizationType.Q4_K


def save(writer: GGUFWriter, path: Path) -> Path:
    """Write what ``writer`` was given to ``path`` (its folder made), and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _check(spec: TestModelSpec) -> None:
    if spec.arch not in ARCHS:
        raise TestModelError(f"unknown arch {spec.arch!r}: use one of {', '.join(ARCHS)}")
    for dtype in (spec.dtype, spec.expert_dtype or spec.dtype):
        if dtype not in DTYPES:
            raise TestModelError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if spec.n_head % spec.n_head_kv:
        raise TestModelError(f"n_head {spec.n_head} must be a multiple of "
                             f"n_head_kv {spec.n_head_kv}")
    if spec.head_dim % 2:
        raise TestModelError(f"head_dim {spec.head_dim} must be even (RoPE rotates pairs)")
    if spec.routed and not 0 < spec.n_expert_used <= spec.n_expert:
        raise TestModelError(f"n_expert_used {spec.n_expert_used} must be in "
                             f"1..n_expert {spec.n_expert}")
    if spec.arch == "gemma3" and (spec.sliding_window < 1 or spec.swa_pattern < 0):
        raise TestModelError(f"sliding_window {spec.sliding_window} must be at least 1 and "
                             f"swa_pattern {spec.swa_pattern} at least 0")
    if spec.hybrid and (spec.ssm_v_heads % spec.ssm_k_heads or spec.n_rot % 8
                        or not 0 < spec.n_rot <= spec.head_dim or spec.full_attention_interval < 1):
        raise TestModelError(f"ssm_v_heads {spec.ssm_v_heads} must be a multiple of ssm_k_heads "
                             f"{spec.ssm_k_heads}, n_rot {spec.n_rot} a multiple of 8 up to "
                             f"head_dim {spec.head_dim}, full_attention_interval at least 1")
    block = max(GGML_QUANT_SIZES[DTYPES[t]][0] for t in (spec.dtype, spec.expert_dtype or
                                                           spec.dtype))
    rows = {"n_embd": spec.n_embd, "n_head*head_dim": spec.n_head * spec.head_dim}
    rows.update({"n_ff_exp": spec.n_ff_exp} if spec.routed else {"n_ff": spec.n_ff})
    if spec.hybrid:
        rows["ssm_head_dim*ssm_v_heads"] = spec.ssm_head_dim * spec.ssm_v_heads
    if spec.arch == "qwen35moe":
        rows["n_ff_shexp"] = spec.n_ff_shexp
    for what, n in rows.items():
        if n % block:
            raise TestModelError(f"{what} = {n} must be a multiple of {block} for {spec.dtype}")


def _write_metadata(w: GGUFWriter, s: TestModelSpec, n_vocab: int) -> None:
    w.add_name(s.name or f"kvasir-test {s.arch} {s.dtype} seed {s.seed}")
    w.add_type("model")
    w.add_block_count(s.n_layer)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.n_embd)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(n_vocab)
    if s.arch in ("qwen3moe", "qwen3", "gemma3", "qwen35moe", "qwen35", "gpt-oss"):
        w.add_feed_forward_length(s.n_ff)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    else:
        w.add_feed_forward_length(s.n_ff_exp if s.routed else s.n_ff)
        w.add_rope_dimension_count(s.head_dim)
    if s.routed:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
    if s.arch in ("qwen3moe", "qwen35moe", "gpt-oss"):
        w.add_expert_feed_forward_length(s.n_ff_exp)
    if s.arch == "gpt-oss":
        w.add_sliding_window(s.sliding_window)
        if s.swa_pattern != 2:
            w.add_uint32("gpt-oss.attention.sliding_window_pattern", s.swa_pattern)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(int(s.context_length / s.yarn_factor))
    if s.arch == "qwen35moe":
        w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    if s.hybrid:
        w.add_rope_dimension_count(s.n_rot)
        w.add_rope_dimension_sections([s.n_rot // 4, s.n_rot // 8, s.n_rot // 8, 0])
        w.add_full_attention_interval(s.full_attention_interval)
        w.add_ssm_conv_kernel(s.ssm_conv)
        w.add_ssm_inner_size(s.ssm_head_dim * s.ssm_v_heads)
        w.add_ssm_state_size(s.ssm_head_dim)
        w.add_ssm_time_step_rank(s.ssm_v_heads)
        w.add_ssm_group_count(s.ssm_k_heads)
    if s.arch == "gemma3":
        w.add_sliding_window(s.sliding_window)
        w.add_uint32("gemma3.attention.sliding_window_pattern", s.swa_pattern)
        w.add_float32("gemma3.rope.freq_base_swa", s.rope_base_swa)
        if s.logit_softcap:
            w.add_final_logit_softcapping(s.logit_softcap)


def _tensors(s: TestModelSpec, n_vocab: int, rng: np.random.Generator):
    """(name, float32 array in numpy order, type) in file order; draws rng in a fixed order."""
    mat = DTYPES[s.dtype]
    big = GGMLQuantizationType.Q8_0 if mat in _K_QUANTS else mat
    f32 = GGMLQuantizationType.F32
    e, q, kv = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / math.sqrt(shape[-1]))

    def norm(n: int) -> np.ndarray:
        return 1 + np.float32(0.1) * rng.standard_normal(n, dtype=np.float32)

    yield "token_embd.weight", rng.standard_normal((n_vocab, e), dtype=np.float32), big
    for i in range(s.n_layer):
        if s.hybrid:
            yield from _hybrid_layer(s, i, w, norm)
            continue
        if s.arch == "gpt-oss":
            yield from _gpt_oss_layer(s, i, w, norm)
            continue
        b = f"blk.{i}."
        yield b + "attn_norm.weight", norm(e), f32
        yield b + "attn_q.weight", w(q, e), mat
        yield b + "attn_k.weight", w(kv, e), mat
        yield b + "attn_v.weight", w(kv, e), mat
        if s.qk_norm:
            yield b + "attn_q_norm.weight", norm(s.head_dim), f32
            yield b + "attn_k_norm.weight", norm(s.head_dim), f32
        yield b + "attn_output.weight", w(e, q), mat
        if s.arch == "gemma3":
            yield b + "post_attention_norm.weight", norm(e), f32
        yield b + "ffn_norm.weight", norm(e), f32
        if s.routed:
            yield b + "ffn_gate_inp.weight", np.float32(4) * w(s.n_expert, e), f32
            k = s.distinct_experts or s.n_expert
            for kind, shape in (("gate", (s.n_ff_exp, e)), ("up", (s.n_ff_exp, e)),
                                ("down", (e, s.n_ff_exp))):
                yield (b + f"ffn_{kind}_exps.weight",
                       w(k, *shape) if k == s.n_expert else Repeated(w(k, *shape), s.n_expert),
                       mat)
        else:
            yield b + "ffn_gate.weight", w(s.n_ff, e), mat
            yield b + "ffn_up.weight", w(s.n_ff, e), mat
            yield b + "ffn_down.weight", w(e, s.n_ff), mat
        if s.arch == "gemma3":
            yield b + "post_ffw_norm.weight", norm(e), f32
    yield "output_norm.weight", norm(e), f32
    if not s.tied:
        yield "output.weight", w(n_vocab, e), big


def _hybrid_layer(s: TestModelSpec, i: int, w: Any, norm: Any):
    """A Qwen3.5 layer: a delta-net or gated attention, then the FFN on the post-attention
    norm (routed experts and a sigmoid-gated shared expert for qwen35moe)."""
    mat, f32, b, e = DTYPES[s.dtype], GGMLQuantizationType.F32, f"blk.{i}.", s.n_embd
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    d, hv = s.ssm_head_dim, s.ssm_v_heads
    yield b + "attn_norm.weight", norm(e), f32
    if s.recurrent(i):
        channels = d * (2 * s.ssm_k_heads + hv)
        yield b + "attn_qkv.weight", w(channels, e), mat
        yield b + "attn_gate.weight", w(d * hv, e), mat
        yield b + "ssm_conv1d.weight", w(channels, s.ssm_conv), f32
        yield b + "ssm_dt.bias", np.float32(0.5) * w(hv, 1)[:, 0], f32
        yield b + "ssm_a", -np.exp(np.float32(0.5) * w(hv, 1)[:, 0]), f32
        yield b + "ssm_beta.weight", w(hv, e), mat
        yield b + "ssm_alpha.weight", w(hv, e), mat
        yield b + "ssm_norm.weight", norm(d), f32
        yield b + "ssm_out.weight", w(e, d * hv), mat
    else:
        yield b + "attn_q.weight", w(2 * q, e), mat   # per head: its query, then its gate
        yield b + "attn_k.weight", w(kv, e), mat
        yield b + "attn_v.weight", w(kv, e), mat
        yield b + "attn_q_norm.weight", norm(s.head_dim), f32
        yield b + "attn_k_norm.weight", norm(s.head_dim), f32
        yield b + "attn_output.weight", w(e, q), mat
    yield b + "post_attention_norm.weight", norm(e), f32
    if not s.routed:
        yield b + "ffn_gate.weight", w(s.n_ff, e), mat
        yield b + "ffn_up.weight", w(s.n_ff, e), mat
        yield b + "ffn_down.weight", w(e, s.n_ff), mat
        return
    yield b + "ffn_gate_inp.weight", np.float32(4) * w(s.n_expert, e), f32
    yield b + "ffn_gate_exps.weight", w(s.n_expert, s.n_ff_exp, e), mat
    yield b + "ffn_up_exps.weight", w(s.n_expert, s.n_ff_exp, e), mat
    yield b + "ffn_down_exps.weight", w(s.n_expert, e, s.n_ff_exp), mat
    yield b + "ffn_gate_inp_shexp.weight", np.float32(4) * w(1, e)[0], f32
    yield b + "ffn_gate_shexp.weight", w(s.n_ff_shexp, e), mat
    yield b + "ffn_up_shexp.weight", w(s.n_ff_shexp, e), mat
    yield b + "ffn_down_shexp.weight", w(e, s.n_ff_shexp), mat


def _gpt_oss_layer(s: TestModelSpec, i: int, w: Any, norm: Any):
    """A gpt-oss layer: biased Q/K/V/O, each head's sink, the post-attention norm, a biased
    router and experts with biases (in expert_dtype)."""
    mat, f32, b, e = DTYPES[s.dtype], GGMLQuantizationType.F32, f"blk.{i}.", s.n_embd
    exp = DTYPES[s.expert_dtype or s.dtype]
    q, kv, n, ff = s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_expert, s.n_ff_exp

    def bias(*shape: int) -> np.ndarray:
        return np.float32(0.1) * w(*shape, 1)[..., 0]

    yield b + "attn_norm.weight", norm(e), f32
    for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
        yield b + name + ".weight", w(rows, e), mat
        yield b + name + ".bias", bias(rows), f32
    yield b + "attn_output.weight", w(e, q), mat
    yield b + "attn_output.bias", bias(e), f32
    yield b + "attn_sinks.weight", np.float32(2) * w(s.n_head, 1)[:, 0], f32
    yield b + "post_attention_norm.weight", norm(e), f32
    yield b + "ffn_gate_inp.weight", np.float32(4) * w(n, e), f32
    yield b + "ffn_gate_inp.bias", bias(n), f32
    yield b + "ffn_gate_exps.weight", w(n, ff, e), exp
    yield b + "ffn_gate_exps.bias", bias(n, ff), f32
    yield b + "ffn_up_exps.weight", w(n, ff, e), exp
    yield b + "ffn_up_exps.bias", bias(n, ff), f32
    yield b + "ffn_down_exps.weight", w(n, e, ff), exp
    yield b + "ffn_down_exps.bias", bias(n, e), f32


@dataclass(frozen=True)
class Repeated:
    """A stack of ``n`` matrices that repeats ``base``'s (``distinct_experts``): quantized
    once, its bytes tiled."""

    base: np.ndarray
    n: int

    def tiled(self, data: np.ndarray) -> np.ndarray:
        reps = -(-self.n // data.shape[0])
        return np.concatenate([data] * reps)[:self.n]


def _add_tensor(w: GGUFWriter, name: str, data: np.ndarray | Repeated,
                qtype: GGMLQuantizationType) -> None:
    if isinstance(data, Repeated):
        base = data.base if qtype == GGMLQuantizationType.F32 else (
            data.base.astype(np.float16) if qtype == GGMLQuantizationType.F16
            else quantize(data.base, qtype))
        w.add_tensor(name, data.tiled(base), raw_dtype=None if base.dtype != np.uint8
                     else qtype)
        return
    if qtype == GGMLQuantizationType.F32:
        w.add_tensor(name, data)
    elif qtype == GGMLQuantizationType.F16:
        w.add_tensor(name, data.astype(np.float16))
    else:
        w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize float32 rows with ggml's own kernels: uint8 of shape (..., rows, row_bytes)."""
    import ggml

    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, data.shape[-1])
    n_per_row = rows.shape[1]
    out = np.empty((rows.shape[0], n_per_row // block * type_size), dtype=np.uint8)
    src = rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def part(first: int, n: int) -> None:  # rows are independent: one part per core
        ggml.ggml_quantize_chunk(int(qtype), src, out.ctypes.data, first * n_per_row, n,
                                 n_per_row, None)

    step = max(1, -(-rows.shape[0] // (os.cpu_count() or 1)))
    if rows.shape[0] * n_per_row < 1 << 20 or step == rows.shape[0]:
        part(0, rows.shape[0])
    else:
        with ThreadPoolExecutor() as pool:  # ctypes lets go of the GIL during the call
            list(pool.map(lambda a: part(a, min(step, rows.shape[0] - a)),
                          range(0, rows.shape[0], step)))
    return out.reshape(*data.shape[:-1], out.shape[1])


_TOKENIZER_CACHE_VERSION = 1


@lru_cache(maxsize=1)
def bundled_tokenizer() -> dict[str, tuple[int, int, Any]]:
    """The bundled model's `tokenizer.*` keys as {key: (type, array sub-type or 0, value)}.

    Parsing the 98 MB GGUF takes over a second, so the keys are cached as JSON beside it.
    """
    cache = bundled.cache_dir() / f"{bundled.SHA256[:16]}.tokenizer.json"
    if cache.exists():
        doc = json.loads(cache.read_text())
        if doc.get("version") == _TOKENIZER_CACHE_VERSION:
            return {k: tuple(v) for k, v in doc["keys"].items()}  # type: ignore[misc]
    keys = _read_tokenizer(bundled.bundled_path())
    part = cache.with_suffix(f".{os.getpid()}.part")  # concurrent writers never share a file
    part.write_text(json.dumps({"version": _TOKENIZER_CACHE_VERSION, "keys": keys}))
    part.replace(cache)
    return keys


def _read_tokenizer(path: Path) -> dict[str, tuple[int, int, Any]]:
    reader = GGUFReader(path)
    keys: dict[str, tuple[int, int, Any]] = {}
    for key, fld in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub = int(fld.types[-1]) if fld.types[0] == GGUFValueType.ARRAY else 0
        value = fld.contents()
        if isinstance(value, bool | int | float):
            value = value if not isinstance(value, np.generic) else value.item()
        keys[key] = (int(fld.types[0]), sub, value)
    return keys

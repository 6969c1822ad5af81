"""The float64 oracle: llama (dense and with experts), qwen3, qwen3moe, gemma3, the
Qwen3.5 hybrids (qwen35, qwen35moe) and gpt-oss in plain numpy, from dequantized weights.

Independent of the engine on purpose: no ggml op, no shared block code, not even its
architecture table: a layer is computed from `Features` (RoPE mode, Q/K norms, routed
experts), which `FEATURES` gives per llama.cpp architecture name. Weights are
dequantized by gguf-py (only the GGUF header is read through ggml's parser, for speed).
It is the reference the tests and `kvasird verify` measure the engine against; it is
slow (minutes per token on a large model) and never serves requests.

Shapes are numpy order: a hidden state is [T, n_embd]; a weight W of ggml shape
[n_in, n_out] is a numpy [n_out, n_in] matrix, applied as x @ W.T.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvasird.compute.errors import WeightsError
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.hparams import HParams


@dataclass(frozen=True)
class Features:
    """What sets one architecture's layer apart from another's."""

    rope_neox: bool = False
    """RoPE rotates the two halves of a head (NEOX) rather than adjacent pairs."""
    qk_norm: bool = False
    """Per-head RMS norms of queries and keys before RoPE."""
    experts: bool = False
    """Routed experts (softmax, top-k, renormalised) in place of the dense FFN."""
    post_norms: bool = False
    """RMS norms of the attention and FFN outputs before each residual add."""
    geglu: bool = False
    """GELU (tanh approximation) gates the FFN instead of SiLU."""
    embed_scale: bool = False
    """Embedding rows multiplied by sqrt(n_embd)."""
    hybrid: bool = False
    """Qwen3.5: the file's recurrent layers are gated delta-nets, the others attend with a
    sigmoid output gate and partial RoPE; the FFN reads the post-attention norm and a
    shared expert (where the file has one) joins the routed ones."""
    oai_experts: bool = False
    """gpt-oss: the FFN reads the post-attention norm, the router takes the top k of its
    logits and softmaxes those, and the experts' SwiGLU is clamped. (Biases and attention
    sinks are used wherever the file has them.)"""


FEATURES: dict[str, Features] = {
    "llama": Features(),
    "qwen3": Features(rope_neox=True, qk_norm=True),
    "qwen3moe": Features(rope_neox=True, qk_norm=True),
    "gemma3": Features(rope_neox=True, qk_norm=True, post_norms=True, geglu=True, embed_scale=True),
    "qwen35": Features(rope_neox=True, qk_norm=True, hybrid=True),
    "qwen35moe": Features(rope_neox=True, qk_norm=True, hybrid=True),
    "gpt-oss": Features(rope_neox=True, oai_experts=True),
}
"""Per llama.cpp architecture name, from llama-model.cpp's rope types and the models/
graphs. Whether a layer has experts is read from the file, and so are the numbers
(sliding window and its layers, RoPE bases and scaling, attention scale, logit soft-cap)."""


def features_of(hp: HParams) -> Features:
    if hp.arch not in FEATURES:
        raise WeightsError(
            f"the oracle has no architecture {hp.arch!r} (it knows {', '.join(FEATURES)})"
        )
    return dataclasses.replace(FEATURES[hp.arch], experts=hp.n_expert > 0)


@dataclass
class OracleCache:
    """Keys and values per layer, [n_past, n_head_kv, head_dim] float64."""

    k: dict[int, np.ndarray] = field(default_factory=dict)
    """Cached keys (after RoPE) per layer."""
    v: dict[int, np.ndarray] = field(default_factory=dict)
    """Cached values per layer."""
    conv: dict[int, np.ndarray] = field(default_factory=dict)
    """Delta-net layers: the convolution's last inputs, [ssm_conv - 1, channels]."""
    delta: dict[int, np.ndarray] = field(default_factory=dict)
    """Delta-net layers: the state per value head, [heads, d_k, d_v]."""


class Oracle:
    """A whole model in float64; every step is a method so tests can compare any boundary."""

    def __init__(self, path: str | Path, emulate: bool = False, kv_f16: bool = False) -> None:
        self.file = GGUFFile(path)
        self.hp = HParams.from_gguf(self.file)
        self.features = features_of(self.hp)
        self.emulate = emulate
        """Round activations as ggml's CPU matmuls do (to the weight type's dot-product type)."""
        self.kv_f16 = kv_f16
        """Round cached keys and values to float16, as an F16 KV cache does."""
        self._w: dict[str, np.ndarray] = {}

    def mm(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T, with x rounded as ggml would round it for W's type when emulating."""
        out = self.act(x, name) @ self.w(name).T
        if self.emulate and GGMLQuantizationType(self.file.info(name).type) in _MIN_TYPES:
            out += self._q8_1_sum_term(x, name)
        return out

    def _q8_1_sum_term(self, x: np.ndarray, name: str) -> np.ndarray:
        """Q4_1/Q5_1 dot products add min·s with s = fp16(d·Σq) of the Q8_1 block, not the
        exact d16·Σq the dequantized product implies: the difference, per output."""
        b = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, 32)
        amax = np.abs(b).max(axis=-1)
        d = amax / np.float32(127)
        inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
        qsum = np.round(b * inv[..., None]).sum(axis=-1)
        s16 = (d * qsum).astype(np.float16).astype(np.float64)
        exact = d.astype(np.float16).astype(np.float64) * qsum
        return (s16 - exact) @ self._block_mins(name).T

    def _block_mins(self, name: str) -> np.ndarray:
        key = name + "#mins"
        if key not in self._w:
            info = self.file.info(name)
            block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.type)][1]
            raw = np.array(self.file.data(name)).reshape(info.ne[1], -1, block_bytes)
            self._w[key] = raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        return self._w[key]

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ name.weight.T, plus name.bias where the file has one."""
        out = self.mm(x, name + ".weight")
        return out + self.w(name + ".bias") if name + ".bias" in self.file.tensors else out

    def act(self, x: np.ndarray, name: str) -> np.ndarray:
        if not self.emulate:
            return x
        return round_activations(x, GGMLQuantizationType(self.file.info(name).type))

    def w(self, name: str) -> np.ndarray:
        if name not in self._w:
            info = self.file.info(name)
            raw = np.array(self.file.data(name))
            qtype = GGMLQuantizationType(info.type)
            shape = tuple(reversed(info.ne))
            if qtype == GGMLQuantizationType.F32:
                arr: np.ndarray = raw.view(np.float32).reshape(shape)
            elif qtype == GGMLQuantizationType.F16:
                arr = raw.view(np.float16).reshape(shape)
            else:
                row_bytes = info.nbytes // int(np.prod(shape[:-1]))
                arr = dequantize(raw.reshape(*shape[:-1], row_bytes), qtype)
            self._w[name] = arr.astype(np.float64)
        return self._w[name]

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        x = self.w("token_embd.weight")[np.asarray(tokens)]
        return x * np.sqrt(self.hp.n_embd) if self.features.embed_scale else x

    def rms_norm(self, x: np.ndarray, weight: str | None = None) -> np.ndarray:
        y = rms_norm(x, self.hp.rms_eps)
        return y * self.w(weight) if weight else y

    def rope(self, x: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
        """x [T, heads, d]: halves rotated (NEOX) or adjacent pairs, as the features say,
        with the layer's base (sliding-window layers may have their own)."""
        hp = self.hp
        base, scale = (
            (hp.rope_base_swa, hp.rope_scale_swa)
            if hp.is_swa(layer)
            else (hp.rope_base, hp.rope_scale)
        )
        n = hp.rot_dims
        yarn = Yarn(scale, hp.yarn_ext, hp.yarn_attn, hp.rope_ctx)
        turned = rope(x[..., :n], positions, base, neox=self.features.rope_neox, yarn=yarn)
        return np.concatenate([turned, x[..., n:]], axis=-1)

    def attention(self, layer: int, x: np.ndarray, start: int, cache: OracleCache) -> np.ndarray:
        hp, p, T = self.hp, f"blk.{layer}.", len(x)
        h = self.rms_norm(x, p + "attn_norm.weight")
        if self.features.hybrid and hp.is_recurrent(layer):
            return x + self.delta_net(layer, h, start, cache)
        if self.features.hybrid:  # each head's query, then its output gate
            qg = self.mm(h, p + "attn_q.weight").reshape(T, hp.n_head, 2 * hp.head_dim)
            q, gate = qg[..., : hp.head_dim], qg[..., hp.head_dim :].reshape(T, -1)
        else:
            q = self.linear(h, p + "attn_q").reshape(T, hp.n_head, hp.head_dim)
        k = self.linear(h, p + "attn_k").reshape(T, hp.n_head_kv, hp.head_dim)
        v = self.linear(h, p + "attn_v").reshape(T, hp.n_head_kv, hp.head_dim)
        if self.features.qk_norm:
            q = self.rms_norm(q, p + "attn_q_norm.weight")
            k = self.rms_norm(k, p + "attn_k_norm.weight")
        pos = np.arange(start, start + T)
        q, k = self.rope(q, pos, layer), self.rope(k, pos, layer)
        if self.kv_f16:
            k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
        ks = np.concatenate([cache.k.get(layer, k[:0])[:start], k])
        vs = np.concatenate([cache.v.get(layer, v[:0])[:start], v])
        cache.k[layer], cache.v[layer] = ks, vs
        group = hp.n_head // hp.n_head_kv
        kh = np.repeat(ks, group, axis=1)  # [S, H, d]
        vh = np.repeat(vs, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, kh) * (hp.attn_scale or hp.head_dim**-0.5)
        back = pos[:, None] - np.arange(len(ks))[None, :]
        allowed = (back >= 0) & ((back < hp.n_swa) if hp.is_swa(layer) else True)
        scores = np.where(allowed[None], scores, -np.inf)
        sinks = p + "attn_sinks.weight"
        if sinks in self.file.tensors:  # one more logit per head, its weight dropped
            sink = np.broadcast_to(self.w(sinks)[:, None, None], (*scores.shape[:2], 1))
            probs = softmax(np.concatenate([scores, sink], axis=-1))[..., :-1]
        else:
            probs = softmax(scores)
        out = np.einsum("hts,shd->thd", probs, vh).reshape(T, hp.n_head * hp.head_dim)
        if self.features.hybrid:
            out = out * sigmoid(gate)
        return x + self.post_norm(
            self.linear(out, p + "attn_output"), p + "post_attention_norm.weight"
        )

    def delta_net(self, layer: int, h: np.ndarray, start: int, cache: OracleCache) -> np.ndarray:
        """A gated delta-net over normed rows h [T, n_embd], token by token from the cached
        state (zero at position 0): causal depthwise convolution, SiLU, L2-normalised q and
        k (value head j reads key head j mod n_k), then per head S <- e^g S,
        S <- S + k (beta (v - S^T k))^T, o = S^T q / sqrt(d); out RMSNorm(o)·w·silu(z)."""
        hp, p, T = self.hp, f"blk.{layer}.", len(h)
        d, hk, hv, width = hp.ssm_head_dim, hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_conv
        fresh = start == 0 or layer not in cache.conv
        held = np.zeros((width - 1, hp.conv_channels)) if fresh else cache.conv[layer]
        seq = np.concatenate([held, self.mm(h, p + "attn_qkv.weight")])  # [width-1+T, C]
        cache.conv[layer] = seq[T:]
        conv = causal_conv(seq, self.w(p + "ssm_conv1d.weight"))
        conv = conv * sigmoid(conv)
        q = l2_norm(conv[:, : d * hk].reshape(T, hk, d), hp.rms_eps)
        k = l2_norm(conv[:, d * hk : 2 * d * hk].reshape(T, hk, d), hp.rms_eps)
        v = conv[:, 2 * d * hk :].reshape(T, hv, d)
        beta = sigmoid(self.mm(h, p + "ssm_beta.weight"))
        g = softplus(self.mm(h, p + "ssm_alpha.weight") + self.w(p + "ssm_dt.bias")) * self.w(
            p + "ssm_a"
        )
        state = np.zeros((hv, d, d)) if fresh else cache.delta[layer]
        out, cache.delta[layer] = delta_rule(q, k, v, g, beta, state)
        z = self.mm(h, p + "attn_gate.weight").reshape(T, hv, d)
        gated = self.rms_norm(out, p + "ssm_norm.weight") * (z * sigmoid(z))
        return self.mm(gated.reshape(T, hv * d), p + "ssm_out.weight")

    def post_norm(self, out: np.ndarray, weight: str) -> np.ndarray:
        return self.rms_norm(out, weight) if self.features.post_norms else out

    def glu(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        if not self.features.geglu:
            return swiglu(g, u)
        return (gelu_f16_table(g) if self.emulate else gelu(g)) * u

    @property
    def ffn_norm(self) -> str:
        """The FFN input's norm (the hybrids norm it with post_attention_norm)."""
        return (
            "post_attention_norm.weight"
            if self.features.hybrid or self.features.oai_experts
            else "ffn_norm.weight"
        )

    def dense_ffn(self, layer: int, x: np.ndarray) -> np.ndarray:
        p = f"blk.{layer}."
        h = self.rms_norm(x, p + self.ffn_norm)
        return x + self.post_norm(self.swiglu_ffn(h, p, ""), p + "post_ffw_norm.weight")

    def swiglu_ffn(self, h: np.ndarray, p: str, kind: str) -> np.ndarray:
        g, u = self.mm(h, p + f"ffn_gate{kind}.weight"), self.mm(h, p + f"ffn_up{kind}.weight")
        return self.mm(self.glu(g, u), p + f"ffn_down{kind}.weight")

    def route(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(normed rows, top-k ids [T, k] best first, renormalised weights [T, k]); gpt-oss:
        the top k of the logits, their softmax the weights."""
        h = self.rms_norm(x, f"blk.{layer}." + self.ffn_norm)
        logits = self.linear(h, f"blk.{layer}.ffn_gate_inp")
        probs = logits if self.features.oai_experts else softmax(logits)
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, : self.hp.n_expert_used]
        w = np.take_along_axis(probs, ids, axis=-1)
        if self.features.oai_experts:
            return h, ids, softmax(w)
        return h, ids, w / w.sum(axis=-1, keepdims=True)

    def experts(self, layer: int, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """[T, k, n_embd]: expert ids[t, j]'s FFN applied to rows[t] (ids are global)."""
        p = f"blk.{layer}."
        gate, up, down = (
            self.w(p + n)
            for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
        )
        xq = self.act(rows, p + "ffn_gate_exps.weight")
        g = np.einsum("tkfe,te->tkf", gate[ids], xq) + self.expert_bias(p + "ffn_gate_exps", ids)
        u = np.einsum("tkfe,te->tkf", up[ids], xq) + self.expert_bias(p + "ffn_up_exps", ids)
        act = swiglu_oai(g, u, self.hp.swiglu_limit) if self.features.oai_experts else swiglu(g, u)
        par = self.act(act, p + "ffn_down_exps.weight")
        return np.einsum("tkef,tkf->tke", down[ids], par) + self.expert_bias(
            p + "ffn_down_exps", ids
        )

    def expert_bias(self, name: str, ids: np.ndarray) -> np.ndarray | float:
        """Each routed expert's bias [T, k, n] for name.bias (0 where the file has none)."""
        bias = name + ".bias"
        return self.w(bias)[ids] if bias in self.file.tensors else 0.0

    def moe_ffn(self, layer: int, x: np.ndarray) -> np.ndarray:
        h, ids, w = self.route(layer, x)
        out = np.einsum("tk,tke->te", w, self.experts(layer, h, ids))
        if self.hp.n_ff_shexp:
            p = f"blk.{layer}."
            gate = sigmoid(self.mm(h, p + "ffn_gate_inp_shexp.weight"))
            out = out + self.swiglu_ffn(h, p, "_shexp") * gate.reshape(len(h), 1)
        return x + out

    def layer(self, layer: int, x: np.ndarray, start: int, cache: OracleCache) -> np.ndarray:
        x = self.attention(layer, x, start, cache)
        return self.moe_ffn(layer, x) if self.features.experts else self.dense_ffn(layer, x)

    def head(self, x: np.ndarray) -> np.ndarray:
        out = "output.weight" if "output.weight" in self.file.tensors else "token_embd.weight"
        logits = self.mm(self.rms_norm(x, "output_norm.weight"), out)
        cap = self.hp.logit_softcap
        return cap * np.tanh(logits / cap) if cap else logits

    def hidden(self, tokens: np.ndarray, layers: int | None = None) -> list[np.ndarray]:
        """Hidden states after the embedding and after each layer (prefill from position 0)."""
        cache = OracleCache()
        xs = [self.embed(tokens)]
        for layer in range(self.hp.n_layer if layers is None else layers):
            xs.append(self.layer(layer, xs[-1], 0, cache))
        return xs

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits [T, n_vocab] for a prompt (prefill)."""
        return self.head(self.hidden(tokens)[-1])

    def generate(self, tokens: np.ndarray, n: int) -> tuple[list[int], np.ndarray]:
        """Greedy continuation with a KV cache: (tokens, last-position logits per step)."""
        cache, out, steps = OracleCache(), [], []
        x, start = np.asarray(tokens), 0
        for _ in range(n):
            h = self.embed(x)
            for layer in range(self.hp.n_layer):
                h = self.layer(layer, h, start, cache)
            logits = self.head(h[-1:])[0]
            start += len(x)
            steps.append(logits)
            out.append(int(np.argmax(logits)))
            x = np.array([out[-1]])
        return out, np.array(steps)


def softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum x^2 + eps) along the last axis (what llama.cpp's delta-nets compute)."""
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def causal_conv(seq: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Depthwise convolution of seq [width - 1 + T, C] (the held inputs, then T new ones)
    with kernel [C, width], column width - 1 weighing the current input: [T, C]."""
    width = kernel.shape[1]
    return np.stack(
        [(seq[t : t + width] * kernel.T).sum(axis=0) for t in range(len(seq) - width + 1)]
    )


def delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token: q, k [T, n_k, d], v [T, n_v, d], g and beta
    [T, n_v], state [n_v, d_k, d_v]; value head j reads key head j mod n_k. Per token and
    head S <- e^g S; S <- S + k (beta (v - S^T k))^T; o = S^T q / sqrt(d).
    Returns (o [T, n_v, d], the last state)."""
    T, hv, d = v.shape
    tile = np.arange(hv) % k.shape[1]
    out = np.empty((T, hv, d))
    for t in range(T):
        kt, qt = k[t, tile], q[t, tile]  # [hv, d]
        state = state * np.exp(g[t])[:, None, None]
        err = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", state, kt))
        state = state + kt[:, :, None] * err[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, qt) / np.sqrt(d)
    return out, state


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g)) * u


SWIGLU_ALPHA = 1.702
"""The clamped SwiGLU's sigmoid slope (gpt-oss)."""


def swiglu_oai(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    """gpt-oss's clamped SwiGLU: g clamped above and u within ±limit, then
    g·sigmoid(1.702·g)·(u + 1)."""
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1.0 + np.exp(-SWIGLU_ALPHA * g)) * (u + 1.0)


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (ggml_gelu)."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * x * (1.0 + 0.044715 * x * x)))


def gelu_f16_table(x: np.ndarray) -> np.ndarray:
    """GELU as ggml's CPU computes it: looked up in a float16 table by float16(x) (0 at or
    below -10, x at or above 10), the table's entries gelu in float32 rounded to float16."""
    x32 = np.asarray(x, np.float32)
    h = x32.astype(np.float16).astype(np.float32)
    c, a = np.float32(np.sqrt(2.0 / np.pi)), np.float32(0.044715)
    table = np.float32(0.5) * h * (np.float32(1) + np.tanh(c * h * (np.float32(1) + a * h * h)))
    y = table.astype(np.float16).astype(np.float64)
    return np.where(x32 <= -10, 0.0, np.where(x32 >= 10, x, y))


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@dataclass(frozen=True)
class Yarn:
    """RoPE frequency scaling, YaRN's when `ext` is 1 (the defaults: none)."""

    scale: float = 1.0
    """Frequency scale, 1 / the scaling factor."""
    ext: float = 0.0
    """Extrapolation mix: 1 blends interpolated and original frequencies by dimension."""
    attn: float = 1.0
    """Magnitude factor of cos and sin (before YaRN's own 1 + 0.1 ln(1 / scale))."""
    n_ctx_orig: int = 4096
    """The context the corrections are computed for."""
    beta_fast: float = 32.0
    """Rotations per context below which a dimension extrapolates fully..."""
    beta_slow: float = 1.0
    """...and above which it interpolates fully."""

    def angles(self, theta: np.ndarray, d: int, base: float) -> tuple[np.ndarray, float]:
        """(scaled angles, magnitude) for unscaled angles theta [..., d / 2]."""
        interp = self.scale * theta
        if not self.ext:
            return interp, self.attn

        def corr(rotations: float) -> float:
            return d * np.log(self.n_ctx_orig / (rotations * 2 * np.pi)) / (2 * np.log(base))

        low = max(0.0, np.floor(corr(self.beta_fast)))
        high = min(d - 1.0, np.ceil(corr(self.beta_slow)))
        pair = np.arange(d // 2)
        ramp = 1 - np.clip((pair - low) / max(0.001, high - low), 0, 1)
        mix = ramp * self.ext
        return interp * (1 - mix) + theta * mix, self.attn * (1 + 0.1 * np.log(1 / self.scale))


def rope(
    x: np.ndarray, positions: np.ndarray, base: float, neox: bool, yarn: Yarn = Yarn()
) -> np.ndarray:
    """Rotate x [T, heads, d] by position: halves paired (neox) or adjacent pairs (normal),
    frequencies scaled as `yarn` says."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang, mag = yarn.angles(np.asarray(positions, np.float64)[:, None] * inv[None, :], d, base)
    cos, sin = mag * np.cos(ang)[:, None, :], mag * np.sin(ang)[:, None, :]
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty(np.broadcast_shapes(x.shape), np.float64)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


_MIN_TYPES = {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1}
_Q8_0_FAMILY = {GGMLQuantizationType[n] for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")}
_Q8_K_FAMILY = {GGMLQuantizationType[n] for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}


def round_activations(x: np.ndarray, weight_type: GGMLQuantizationType) -> np.ndarray:
    """What ggml's CPU matmul turns activations into before the dot product with `weight_type`.

    F16 weights: activations in float16. Q4/Q5/Q8 and MXFP4 blocks of 32: Q8_0/Q8_1 (scale
    amax/127 stored as float16). K-quants: Q8_K blocks of 256 (scale max/-127 kept in float32).
    """
    x = np.asarray(x, np.float64)
    if weight_type == GGMLQuantizationType.F16:
        return x.astype(np.float32).astype(np.float16).astype(np.float64)
    if weight_type in _Q8_0_FAMILY:
        b = x.astype(np.float32).reshape(-1, 32)
        amax = np.abs(b).max(axis=1, keepdims=True)
        d = amax / np.float32(127)
        inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
        q = np.round(b * inv)
        return (q * d.astype(np.float16).astype(np.float32)).astype(np.float64).reshape(x.shape)
    if weight_type in _Q8_K_FAMILY:
        b = x.astype(np.float32).reshape(-1, 256)
        at = np.abs(b).argmax(axis=1)
        mx = b[np.arange(len(b)), at][:, None]
        iscale = np.divide(np.float32(-127), mx, out=np.zeros_like(mx), where=mx != 0)
        q = np.minimum(np.round(iscale * b), 127)
        d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
        return (q * d).astype(np.float64).reshape(x.shape)
    return x

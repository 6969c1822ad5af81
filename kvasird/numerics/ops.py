"""Single ggml ops against their float64 definitions: the per-op part of the contract.

Each probe builds a one-op graph on the engine's backend, feeds seeded random inputs,
and compares with the oracle's formula. Matmul is probed once per weight type found in
the model, with a real tensor of that type, twice: against exact float64 math (what
quantizing the activations costs) and against the oracle rounding activations as ggml's
CPU kernels do (which must agree to float rounding: any other difference is a bug).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from kvasird.compute.blocks import ROPE_IMROPE, SWIGLU_ALPHA, l2_norm, rope_sections
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.graph import F32, I32, Backend, Builder, Graph, Tensor, ggml
from kvasird.compute.hparams import HParams
from kvasird.compute.weights import load_weights
from kvasird.numerics import oracle
from kvasird.numerics.metrics import Delta, compare


@dataclass(frozen=True)
class OpDelta:
    """One op's engine-vs-oracle distance."""

    op: str
    """Op name, e.g. "rms_norm", "rope_neox", "matmul[Q4_1]"."""
    delta: Delta
    """Its distance from the float64 definition."""
    weight_type: str
    """GGML type of the weight involved ("F32" for activation-only ops)."""


def _run(
    backend: Backend,
    inputs: dict[str, tuple[np.ndarray, int]],
    op: Callable[[Builder, dict], object],
) -> np.ndarray:
    def build(b: Builder) -> dict:
        ts = {k: b.input(k, t, *reversed(a.shape)) for k, (a, t) in inputs.items()}
        return {"out": op(b, ts)}

    g = Graph(backend, build, max_nodes=64)
    try:
        out = g.run({k: a for k, (a, _) in inputs.items()})["out"]
    finally:
        g.close()
    return out


def probe_ops(path: str, backend: Backend, seed: int = 0) -> list[OpDelta]:
    f = GGUFFile(path)
    o = oracle.Oracle(path)
    emulated = oracle.Oracle(path, emulate=True)
    rng = np.random.default_rng(seed)
    T, E = 7, o.hp.n_embd
    x = rng.standard_normal((T, E)).astype(np.float32) * 3
    out = []

    def add(name: str, got: np.ndarray, want: np.ndarray, wtype: str = "F32") -> None:
        out.append(OpDelta(name, compare(got.reshape(want.shape), want), wtype))

    got = _run(
        backend, {"x": (x, F32)}, lambda b, t: ggml.ggml_rms_norm(b.ctx, t["x"], o.hp.rms_eps)
    )
    add("rms_norm", got, oracle.rms_norm(x.astype(np.float64), o.hp.rms_eps))
    got = _run(backend, {"x": (x, F32)}, lambda b, t: ggml.ggml_soft_max(b.ctx, t["x"]))
    add("softmax", got, oracle.softmax(x.astype(np.float64)))
    u = rng.standard_normal((T, E)).astype(np.float32)
    got = _run(
        backend,
        {"g": (x, F32), "u": (u, F32)},
        lambda b, t: ggml.ggml_swiglu_split(b.ctx, t["g"], t["u"]),
    )
    add("swiglu", got, oracle.swiglu(x.astype(np.float64), u.astype(np.float64)))
    d, heads = o.hp.head_dim, o.hp.n_head
    q = rng.standard_normal((T, heads, d)).astype(np.float32)
    pos = np.sort(rng.integers(0, 4096, T)).astype(np.int32)
    for name, mode in (("rope_normal", 0), ("rope_neox", ggml.GGML_ROPE_TYPE_NEOX)):

        def rope(b: Builder, t: dict, mode: int = mode) -> object:
            return ggml.ggml_rope_ext(
                b.ctx,
                t["q"],
                t["pos"],
                None,
                d,
                mode,
                o.hp.n_ctx_train,
                o.hp.rope_base,
                1.0,
                0.0,
                1.0,
                32.0,
                1.0,
            )

        got = _run(backend, {"q": (q, F32), "pos": (pos, I32)}, rope)
        add(name, got, oracle.rope(q.astype(np.float64), pos, o.hp.rope_base, neox=bool(mode)))
    if o.hp.recurrent_layers:
        out += [OpDelta(name, delta, "F32") for name, delta in _delta_net_ops(backend, o.hp, rng)]
    if o.features.oai_experts:
        out += [OpDelta(name, delta, "F32") for name, delta in _gpt_oss_ops(backend, o.hp, rng)]
    for wname in _one_matrix_per_type(f):
        wt = load_weights(f, backend, [wname])
        try:
            tensor = wt.get(wname)
            xin = rng.standard_normal((T, f.info(wname).ne[0])).astype(np.float32)

            def matmul(b: Builder, t: dict, tensor: Tensor = tensor) -> object:
                return ggml.ggml_mul_mat(b.ctx, tensor, t["x"])

            got = _run(backend, {"x": (xin, F32)}, matmul)
            want = xin.astype(np.float64) @ o.w(wname).T
            tname = GGMLQuantizationType(f.info(wname).type).name
            add(f"matmul[{tname}]", got, want, tname)
            add(f"matmul[{tname}] ggml-rounded", got, emulated.mm(xin, wname), tname)
        finally:
            wt.close()
    return out


def _delta_net_ops(backend: Backend, hp: HParams, rng: np.random.Generator):
    """A hybrid's own ops: multi-section RoPE over part of a head, the L2 norm, the causal
    convolution, and the gated delta rule over a sequence from a nonzero state."""
    T, d, hk, hv, width = 7, hp.ssm_head_dim, hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_conv
    n = hp.rot_dims
    x = rng.standard_normal((T, hp.n_head, hp.head_dim)).astype(np.float32)
    pos = np.sort(rng.integers(0, 4096, T)).astype(np.int32)
    got = _run(
        backend,
        {"x": (x, F32), "pos": (np.concatenate([np.tile(pos, 3), 0 * pos]), I32)},
        lambda b, t: ggml.ggml_rope_multi(
            b.ctx,
            t["x"],
            t["pos"],
            None,
            n,
            rope_sections(hp),
            ROPE_IMROPE,
            hp.n_ctx_train,
            hp.rope_base,
            1.0,
            0.0,
            1.0,
            32.0,
            1.0,
        ),
    )
    x64 = x.astype(np.float64)
    want = np.concatenate(
        [oracle.rope(x64[..., :n], pos, hp.rope_base, neox=True), x64[..., n:]], axis=-1
    )
    yield "rope_multi", compare(got.reshape(want.shape), want)
    got = _run(backend, {"x": (x, F32)}, lambda b, t: l2_norm(b.ctx, t["x"], hp.rms_eps))
    yield "l2_norm", compare(got.reshape(x.shape), oracle.l2_norm(x64, hp.rms_eps))
    seq = rng.standard_normal((width - 1 + T, hp.conv_channels)).astype(np.float32)
    kernel = rng.standard_normal((hp.conv_channels, width)).astype(np.float32)
    got = _run(
        backend,
        {"seq": (np.ascontiguousarray(seq.T), F32), "kernel": (kernel, F32)},
        lambda b, t: ggml.ggml_ssm_conv(b.ctx, t["seq"], t["kernel"]),
    )
    want = oracle.causal_conv(seq.astype(np.float64), kernel.astype(np.float64))
    yield "ssm_conv", compare(got.reshape(want.shape), want)
    q, k = (
        oracle.l2_norm(rng.standard_normal((T, hk, d)), 1e-6).astype(np.float32) for _ in range(2)
    )
    v = rng.standard_normal((T, hv, d)).astype(np.float32)
    g = -rng.uniform(0.05, 2.0, (T, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, hv)).astype(np.float32)
    s0 = rng.standard_normal((hv, d, d)).astype(np.float32) * np.float32(0.3)

    def gdn(b: Builder, t: dict) -> Tensor:
        r4 = ggml.ggml_reshape_4d
        return ggml.ggml_gated_delta_net(
            b.ctx,
            r4(b.ctx, t["q"], d, hk, T, 1),
            r4(b.ctx, t["k"], d, hk, T, 1),
            r4(b.ctx, t["v"], d, hv, T, 1),
            r4(b.ctx, t["g"], 1, hv, T, 1),
            r4(b.ctx, t["beta"], 1, hv, T, 1),
            r4(b.ctx, t["s"], d, d, hv, 1),
            1,
        )

    # ggml keeps each head's state transposed: row j holds S[:, j]
    got = _run(
        backend,
        {
            "q": (q, F32),
            "k": (k, F32),
            "v": (v, F32),
            "g": (g, F32),
            "beta": (beta, F32),
            "s": (np.ascontiguousarray(s0.transpose(0, 2, 1)), F32),
        },
        gdn,
    ).reshape(T + d, hv * d)
    o, s = oracle.delta_rule(*(a.astype(np.float64) for a in (q, k, v, g, beta, s0)))
    got_s = got[T:].reshape(hv, d, d).transpose(0, 2, 1)
    yield (
        "gated_delta_net",
        compare(
            np.concatenate([got[:T].ravel(), got_s.ravel()]), np.concatenate([o.ravel(), s.ravel()])
        ),
    )


def _gpt_oss_ops(backend: Backend, hp: HParams, rng: np.random.Generator):
    """gpt-oss's own ops: the softmax with attention sinks, the clamped SwiGLU (inputs on
    both sides of its limit) and RoPE with the model's YaRN scaling."""
    T, heads, d = 7, hp.n_head, hp.head_dim
    kq = rng.standard_normal((heads, T, 12)).astype(np.float32) * 3
    sinks = rng.standard_normal(heads).astype(np.float32) * 3

    def with_sinks(b: Builder, t: dict) -> Tensor:
        probs = ggml.ggml_soft_max_ext(b.ctx, t["kq"], None, 1.0, 0.0)
        ggml.ggml_soft_max_add_sinks(probs, t["sinks"])
        return probs

    got = _run(backend, {"kq": (kq, F32), "sinks": (sinks, F32)}, with_sinks)
    full = np.concatenate([kq, np.broadcast_to(sinks[:, None, None], (heads, T, 1))], axis=-1)
    want = oracle.softmax(full.astype(np.float64))[..., :-1]
    yield "softmax_sinks", compare(got.reshape(want.shape), want)
    g, u = (rng.standard_normal((T, 64)).astype(np.float32) * 6 for _ in range(2))
    got = _run(
        backend,
        {"g": (g, F32), "u": (u, F32)},
        lambda b, t: ggml.ggml_swiglu_oai(b.ctx, t["g"], t["u"], SWIGLU_ALPHA, hp.swiglu_limit),
    )
    want = oracle.swiglu_oai(g.astype(np.float64), u.astype(np.float64), hp.swiglu_limit)
    yield "swiglu_oai", compare(got.reshape(want.shape), want)
    q = rng.standard_normal((T, heads, d)).astype(np.float32)
    pos = np.sort(rng.integers(0, hp.n_ctx_train, T)).astype(np.int32)
    got = _run(
        backend,
        {"q": (q, F32), "pos": (pos, I32)},
        lambda b, t: ggml.ggml_rope_ext(
            b.ctx,
            t["q"],
            t["pos"],
            None,
            d,
            ggml.GGML_ROPE_TYPE_NEOX,
            hp.rope_ctx,
            hp.rope_base,
            hp.rope_scale,
            hp.yarn_ext,
            hp.yarn_attn,
            32.0,
            1.0,
        ),
    )
    yarn = oracle.Yarn(hp.rope_scale, hp.yarn_ext, hp.yarn_attn, hp.rope_ctx)
    want = oracle.rope(q.astype(np.float64), pos, hp.rope_base, neox=True, yarn=yarn)
    yield "rope_yarn", compare(got.reshape(want.shape), want)


def _one_matrix_per_type(f: GGUFFile) -> list[str]:
    """The first 2-D matrix of each type; token_embd only when no other has its type
    (a tied head multiplies by it, but its 49k rows make the probe slower)."""
    names = [n for n in f.tensors if n != "token_embd.weight"] + ["token_embd.weight"]
    seen: dict[int, str] = {}
    for name in names:
        info = f.tensors.get(name)
        if info is not None and len(info.ne) == 2 and info.type not in seen:
            seen[info.type] = name
    return list(seen.values())

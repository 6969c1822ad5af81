"""Building blocks shared by every architecture: norms, attention with the KV pool, the gated
delta-net with its recurrent state, FFNs, router.

Architectures (kvasird/compute/arch/) compose these into a layer. Shapes are in ggml
order: a hidden state is [n_embd, n_tokens]. The per-call inputs every layer of a
graph shares (positions, KV slots, the session's pages, the masks and its recurrent-state
slot; the sliding-window layers' own slots, ring pages and mask where the window pool keeps
their KV) are created once by `Blocks` and set by the stage before each compute. What a graph
writes back without reading it (a delta-net's new state) goes in the builder's effects.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvasird.compute.graph import F32, I32, I64, Builder, Tensor, ggml, ne_of
from kvasird.compute.hparams import HParams
from kvasird.compute.kv.keys import PAGE
from kvasird.compute.kv.pool import KVPool
from kvasird.compute.weights import Weights

ROPE_NORMAL = 0
"""Rotate adjacent pairs (llama)."""
ROPE_NEOX = ggml.GGML_ROPE_TYPE_NEOX
"""Rotate the two halves of each head (qwen3, gpt-neox)."""
ROPE_IMROPE = ggml.GGML_ROPE_TYPE_IMROPE
"""Interleaved multi-section RoPE, halves rotated (Qwen3.5); a text token has the same
position in its first three sections, so it rotates as NEOX over the first n_rot dims."""

SWIGLU = ggml.ggml_swiglu_split
"""silu(gate) * up (llama, qwen3)."""
GEGLU = ggml.ggml_geglu_split
"""gelu(gate) * up, ggml's tanh approximation (gemma)."""
SWIGLU_ALPHA = 1.702
"""The clamped SwiGLU's sigmoid slope (gpt-oss)."""


def mask_name(name: str, group: int) -> str:
    """A graph's mask input for a group of sequences (Blocks.groups): the first's is
    `name`."""
    return name if group == 0 else f"{name}{group}"


def _as(ctx: object, t: Tensor, type_: int) -> Tensor:
    """A view of contiguous t's bytes as type_, row for row (a row's bytes must divide
    evenly): what a byte copy of 16-bit values two to an I32 reads and gives back."""
    if int(t.contents.type) == type_:
        return t
    tc = t.contents  # (a VIEW op: ggml_view_tensor would leave t's op out of the graph)
    view = ggml.ggml_view_4d(
        ctx, t, *(int(tc.ne[i]) for i in range(4)), *(int(tc.nb[i]) for i in range(1, 4)), 0
    )
    c, size = view.contents, ggml.ggml_type_size(type_)
    row = int(c.ne[0]) * int(c.nb[0])
    assert row % size == 0 and int(c.nb[1]) == row, "a view of whole contiguous rows"
    c.type, c.ne[0], c.nb[0] = type_, row // size, size
    return view


def padded_rows(T: int) -> int:
    """The rows a repacked product (graph.REPACKED_TYPES on x86) computes T rows of x as,
    padding with zero rows where that costs less. ggml takes x's rows sixteen at a time,
    then four at a time, then the rest one by one, each pass reading all the weights.
    So 3 rows cost more than 4, and 15 more than 16 (a decode step of T sessions on the
    dense bench model: bench/bench_scale.py --only prefill times batched steps)."""
    if T < 2:
        return T
    if T % 16 >= 10:
        return -(-T // 16) * 16
    return -(-T // 4) * 4 if T % 4 >= 2 else T


def _seqs(ctx: object, t: Tensor, first: int, n: int) -> Tensor:
    """Sequences [first, first + n) of a 4-D tensor (its fourth dimension)."""
    c = t.contents
    return ggml.ggml_view_4d(
        ctx,
        t,
        *(int(c.ne[i]) for i in range(3)),
        n,
        *(int(c.nb[i]) for i in range(1, 4)),
        first * int(c.nb[3]),
    )


def l2_norm(ctx: object, x: Tensor, eps: float) -> Tensor:
    """Each row over sqrt(its squared sum + eps), as llama.cpp's delta-nets compute it: an
    RMS norm with eps / n, scaled by 1 / sqrt(n)."""
    n = ne_of(x)[0]
    return ggml.ggml_scale(ctx, ggml.ggml_rms_norm(ctx, x, eps / n), 1.0 / math.sqrt(n))


def rope_sections(hp: HParams) -> ctypes.Array[ctypes.c_int]:
    """Multi-section RoPE's section sizes as ggml takes them."""
    return (ctypes.c_int * 4)(*hp.rope_sections)


@dataclass(frozen=True)
class RouterOut:
    """What a MoE layer's dense part hands to expert dispatch (all ggml tensors)."""

    resid: Tensor
    """Hidden state after attention, [n_embd, T]: the MoE output is added to it."""
    cur: Tensor
    """FFN-normed hidden state, [n_embd, T]: the rows sent to experts."""
    ids: Tensor
    """Selected global expert ids, [k, T] int32."""
    weights: Tensor
    """Their router weights, [k, T] float32, already normalised by the architecture's rule."""
    shared: Tensor | None = None
    """The gated shared expert's output [n_embd, T], added to the routed experts' sum
    before the residual (qwen35moe), or None."""


class Blocks:
    """Graph-building context for one forward graph over a stage's weights and KV pool."""

    def __init__(
        self,
        b: Builder,
        w: Weights,
        kv: KVPool | None,
        n_tokens: int,
        n_kv: int,
        groups: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        self.b, self.ctx, self.w, self.hp, self.kv = b, b.ctx, w, w.hparams, kv
        self.T, self.n_kv = n_tokens, n_kv
        self.groups = tuple(groups) if groups is not None else ((n_tokens, 1),)
        """Sequences (sessions) whose rows the graph computes together, as (rows, sequences)
        groups: the sequences of a group have as many rows each and come one after the
        other, the groups too. Every sequence attends over its own pages; the projections
        and FFNs read the weights once for all of them."""
        assert sum(r * n for r, n in self.groups) == n_tokens, "the groups' rows are the graph's"
        self.seqs = sum(n for _, n in self.groups)
        self.n_kv_swa = (
            kv.window_span(max(r for r, _ in self.groups), n_kv)
            if kv is not None and kv.window_layers
            else n_kv
        )
        """Slots each sequence's sliding-window layers gather: its ring's pages in the window
        pool, or its pages as the full layers do where the main pool keeps them."""
        self._shared: dict[str, Tensor] = {}
        self.keep: tuple[int, str] | None = None
        """(layer, mode): after that layer's token mixing keep only the rows the caller
        reads on: the last one ("last") or each sequence's last ("lasts"; `mixed`)."""
        self.kept = False
        """Whether `keep` was applied (by the architecture's layer calling `mixed`)."""

    def _input(self, name: str, type_: int, *ne: int) -> Tensor:
        # Created on first use: an input no op reads is never allocated, and setting it would crash.
        if name not in self._shared:
            self._shared[name] = self.b.input(name, type_, *ne)
        return self._shared[name]

    @property
    def pos(self) -> Tensor:
        return self._input("pos", I32, self.T)

    @property
    def slots(self) -> Tensor:
        return self._input("slots", I64, self.T)

    @property
    def v_slots(self) -> Tensor:
        return self._input("v_slots", I64, self.hp.kv_dim * self.T)

    @property
    def kv_pages(self) -> Tensor:
        """Each sequence's pages in position order, one sequence after the other."""
        return self._input("kv_pages", I32, self.seqs * self.n_kv // PAGE)

    def mask(self, group: int) -> Tensor:
        """Per sequence of a group, its rows' causal mask over its gathered slots."""
        rows, seqs = self.groups[group]
        return self._input(mask_name("mask", group), F32, self.n_kv, rows, 1, seqs)

    def last_rows(self, x: Tensor) -> Tensor:
        """Each sequence's last row of x (input "last_rows": their indices)."""
        return ggml.ggml_get_rows(self.ctx, x, self._input("last_rows", I32, self.seqs))

    @property
    def pos_sections(self) -> Tensor:
        """Positions per RoPE section, section-major: each token's position in the first
        three sections, 0 in the fourth (a text token, as llama.cpp feeds them)."""
        return self._input("pos_sections", I32, 4 * self.T)

    @property
    def state_slot(self) -> Tensor:
        """The session's recurrent-state slot, to read its rows."""
        return self._input("state_slot", I32, 1)

    @property
    def state_row(self) -> Tensor:
        """The same slot, to write its rows."""
        return self._input("state_row", I64, 1)

    def mask_swa(self, group: int) -> Tensor:
        """The causal mask narrowed to the sliding window (hp.n_swa newest positions), over
        the slots the sliding-window layers gather."""
        rows, seqs = self.groups[group]
        return self._input(mask_name("mask_swa", group), F32, self.n_kv_swa, rows, 1, seqs)

    @property
    def swa_slots(self) -> Tensor:
        """Window-pool slots of the new tokens."""
        return self._input("swa_slots", I64, self.T)

    @property
    def swa_v_slots(self) -> Tensor:
        return self._input("swa_v_slots", I64, self.hp.kv_dim * self.T)

    @property
    def swa_pages(self) -> Tensor:
        """Per sequence, the ring pages holding its new tokens' windows in position order,
        one sequence after the other."""
        return self._input("swa_pages", I32, self.seqs * self.n_kv_swa // PAGE)

    def t(self, name: str) -> Tensor:
        return self.w.get(name)

    def norm(self, x: Tensor, weight: str) -> Tensor:
        normed = ggml.ggml_rms_norm(self.ctx, x, self.hp.rms_eps)
        return ggml.ggml_mul(self.ctx, normed, self.t(weight))

    def mm(self, weight: str, x: Tensor) -> Tensor:
        """weight · x. In a graph of several sessions a repacked weight's product runs
        over x's rows padded with zero rows where ggml computes that many for less
        (`padded_rows`), the pad dropped. Not for one session's rows: ggml computes the
        rows left over from its passes of four apart (as llama.cpp's prompt does), and a
        row computed in a pass differs from it in the last bits."""
        w, c = self.t(weight), x.contents
        T = int(c.ne[1])
        P = (
            padded_rows(T)
            if self.seqs > 1
            and self.w.packed is not None
            and weight in self.w.packed.tensors
            and int(c.ne[2]) * int(c.ne[3]) == 1
            else T
        )
        if P == T:
            return ggml.ggml_mul_mat(self.ctx, w, x)
        out = ggml.ggml_mul_mat(self.ctx, w, ggml.ggml_pad(self.ctx, x, 0, P - T, 0, 0))
        return ggml.ggml_view_2d(
            self.ctx, out, int(out.contents.ne[0]), T, int(out.contents.nb[1]), 0
        )

    def linear(self, name: str, x: Tensor) -> Tensor:
        """name.weight · x, plus name.bias where the layer has one."""
        out = self.mm(name + ".weight", x)
        bias = name + ".bias"
        return ggml.ggml_add(self.ctx, out, self.t(bias)) if self.w.has(bias) else out

    def embed(self, tokens: Tensor, scale: float | None = None) -> Tensor:
        x = ggml.ggml_get_rows(self.ctx, self.t("token_embd.weight"), tokens)
        return x if scale is None else ggml.ggml_scale(self.ctx, x, scale)

    def head(self, x: Tensor) -> Tensor:
        """Final norm and output matrix (token_embd when `output` is absent: tied), and the
        logit soft-cap where the model has one."""
        out = "output.weight" if self.w.has("output.weight") else "token_embd.weight"
        logits = self.mm(out, self.norm(x, "output_norm.weight"))
        cap = self.hp.logit_softcap
        if cap:
            logits = ggml.ggml_scale(
                self.ctx,
                ggml.ggml_tanh(self.ctx, ggml.ggml_scale(self.ctx, logits, 1.0 / cap)),
                cap,
            )
        return logits

    def last_column(self, x: Tensor) -> Tensor:
        c = x.contents
        row = int(c.nb[1])
        return ggml.ggml_view_2d(self.ctx, x, int(c.ne[0]), 1, row, row * (int(c.ne[1]) - 1))

    def mixed(self, layer: int, x: Tensor) -> Tensor:
        """The residual stream x after `layer`'s token mixing (attention, delta-net): all
        its rows, or in the layer `keep` names only the rows the caller reads on. Every
        row's keys, values and states are written by then; the FFN and the head then skip
        the rest, as llama.cpp's last layer does (its FFN computed for rows nobody reads:
        what that costs a prefill at real widths, see bench/bench_scale.py --only prefill)."""
        if self.keep is None or layer != self.keep[0]:
            return x
        mode, self.kept = self.keep[1], True
        if mode == "lasts" and self.seqs < self.T:
            return self.last_rows(x)
        return self.last_column(x) if mode == "last" and self.T > 1 else x

    def attention(self, layer: int, x: Tensor, rope_mode: int, qk_norm: bool) -> Tensor:
        """x + attn(norm(x))."""
        cur = self.norm(x, f"blk.{layer}.attn_norm.weight")
        return self.mixed(
            layer, ggml.ggml_add(self.ctx, x, self.self_attention(layer, cur, rope_mode, qk_norm))
        )

    def self_attention(
        self, layer: int, cur: Tensor, rope_mode: int, qk_norm: bool, scale_q: bool = False
    ) -> Tensor:
        """attn_output(attention over cur), no residual: GQA, RoPE with the layer's base,
        causal over the session's cached and new tokens, through the sliding window on the
        layers that have one. `scale_q` scales q before the product rather than the
        product itself (gemma), as llama.cpp does: with an F16 cache that rounds otherwise."""
        hp, ctx, p = self.hp, self.ctx, f"blk.{layer}."
        d, T = hp.head_dim, self.T
        q = ggml.ggml_reshape_3d(ctx, self.linear(p + "attn_q", cur), d, hp.n_head, T)
        k = ggml.ggml_reshape_3d(ctx, self.linear(p + "attn_k", cur), d, hp.n_head_kv, T)
        v = self.linear(p + "attn_v", cur)
        if qk_norm:
            q = self.norm(q, p + "attn_q_norm.weight")
            k = self.norm(k, p + "attn_k_norm.weight")
        swa = hp.is_swa(layer)
        q = self.rope(q, rope_mode, layer)
        k = self.rope(k, rope_mode, layer)
        scale = hp.attn_scale or 1.0 / math.sqrt(d)
        if scale_q:
            q, scale = ggml.ggml_scale(ctx, q, scale), 1.0
        out = self.attend(layer, q, k, v, scale, self.mask_swa if swa else self.mask)
        return self.linear(p + "attn_output", out)

    def rope(self, x: Tensor, mode: int, layer: int) -> Tensor:
        """RoPE with the layer's base and frequency scale (sliding-window layers may have
        their own), YaRN-corrected where the model scales with YaRN."""
        hp = self.hp
        swa = hp.is_swa(layer)
        base, scale = (
            (hp.rope_base_swa, hp.rope_scale_swa) if swa else (hp.rope_base, hp.rope_scale)
        )
        yarn = (hp.yarn_ext, hp.yarn_attn, 32.0, 1.0)
        if mode == ROPE_IMROPE:
            return ggml.ggml_rope_multi(
                self.ctx,
                x,
                self.pos_sections,
                None,
                hp.rot_dims,
                rope_sections(hp),
                mode,
                hp.rope_ctx,
                base,
                scale,
                *yarn,
            )
        return ggml.ggml_rope_ext(
            self.ctx, x, self.pos, None, hp.head_dim, mode, hp.rope_ctx, base, scale, *yarn
        )

    def gated_attention(self, layer: int, cur: Tensor) -> Tensor:
        """attn_output(attention(cur) * sigmoid(gate)), no residual: Qwen3.5's full attention.

        One projection gives each head its query and then its gate; Q/K RMS norms, partial
        multi-section RoPE, causal GQA over the session's KV, the output gated per channel.
        """
        hp, ctx, p = self.hp, self.ctx, f"blk.{layer}."
        d, T = hp.head_dim, self.T
        qg = self.mm(p + "attn_q.weight", cur)  # [2 d n_head, T]
        size = ggml.ggml_element_size(qg)
        q, gate = (
            ggml.ggml_view_3d(
                ctx, qg, d, hp.n_head, T, 2 * d * size, 2 * d * hp.n_head * size, at * d * size
            )
            for at in (0, 1)
        )
        gate = ggml.ggml_cont_2d(ctx, gate, d * hp.n_head, T)
        k = ggml.ggml_reshape_3d(ctx, self.mm(p + "attn_k.weight", cur), d, hp.n_head_kv, T)
        q = self.rope(self.norm(q, p + "attn_q_norm.weight"), ROPE_IMROPE, layer)
        k = self.rope(self.norm(k, p + "attn_k_norm.weight"), ROPE_IMROPE, layer)
        out = self.attend(
            layer, q, k, self.mm(p + "attn_v.weight", cur), 1.0 / math.sqrt(d), self.mask
        )
        gated = ggml.ggml_mul(ctx, out, ggml.ggml_sigmoid(ctx, gate))
        return self.mm(p + "attn_output.weight", gated)

    def delta_net(self, layer: int, cur: Tensor) -> Tensor:
        """ssm_out(RMSNorm(o)·ssm_norm·silu(z)), no residual: a gated delta-net layer over the
        session's recurrent state, all T tokens in one op (prefill and decode alike).

        q, k, v come from a causal depthwise convolution (kernel ssm_conv) over the joint
        projection, continued from the session's last ssm_conv - 1 inputs, then SiLU; q
        and k are L2-normalised. Per value head: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T;
        o = S^T q / sqrt(d), with g = softplus(alpha + dt_bias) * ssm_a and beta = sigmoid.
        The convolution's last inputs and S are written back to the session's slot.
        """
        hp, ctx, p, T, pool = self.hp, self.ctx, f"blk.{layer}.", self.T, self.kv
        assert pool is not None
        states = pool.states
        d, hk, hv, C, width = (
            hp.ssm_head_dim,
            hp.ssm_k_heads,
            hp.ssm_v_heads,
            hp.conv_channels,
            hp.ssm_conv,
        )
        qkv = self.mm(p + "attn_qkv.weight", cur)  # [C, T]
        z = ggml.ggml_reshape_4d(ctx, self.mm(p + "attn_gate.weight", cur), d, hv, T, 1)
        beta = ggml.ggml_sigmoid(
            ctx, ggml.ggml_reshape_4d(ctx, self.mm(p + "ssm_beta.weight", cur), 1, hv, T, 1)
        )
        alpha = ggml.ggml_add(ctx, self.mm(p + "ssm_alpha.weight", cur), self.t(p + "ssm_dt.bias"))
        g = ggml.ggml_mul(ctx, ggml.ggml_softplus(ctx, alpha), self.t(p + "ssm_a"))
        g = ggml.ggml_reshape_4d(ctx, g, 1, hv, T, 1)

        held = ggml.ggml_get_rows(ctx, states.conv[layer], self.state_slot)
        held = ggml.ggml_reshape_3d(ctx, held, width - 1, C, 1)
        conv_in = ggml.ggml_concat(
            ctx, held, ggml.ggml_transpose(ctx, ggml.ggml_reshape_3d(ctx, qkv, C, T, 1)), 0
        )  # [width-1+T, C, 1]
        c = conv_in.contents
        tail = ggml.ggml_cont(
            ctx,
            ggml.ggml_view_3d(
                ctx, conv_in, width - 1, C, 1, int(c.nb[1]), int(c.nb[2]), T * int(c.nb[0])
            ),
        )
        self.b.effects.append(
            ggml.ggml_set_rows(
                ctx,
                states.conv[layer],
                ggml.ggml_reshape_2d(ctx, tail, (width - 1) * C, 1),
                self.state_row,
            )
        )
        conv = ggml.ggml_ssm_conv(ctx, conv_in, self.t(p + "ssm_conv1d.weight"))  # [C, T, 1]
        conv = ggml.ggml_silu(ctx, conv)
        f = ggml.ggml_element_size(conv)

        def heads(n: int, at: int) -> Tensor:
            return ggml.ggml_view_4d(ctx, conv, d, n, T, 1, d * f, C * f, C * f * T, at * f)

        q, k, v = heads(hk, 0), heads(hk, d * hk), heads(hv, 2 * d * hk)
        q, k = l2_norm(ctx, q, hp.rms_eps), l2_norm(ctx, k, hp.rms_eps)
        s0 = ggml.ggml_reshape_4d(
            ctx, ggml.ggml_get_rows(ctx, states.delta[layer], self.state_slot), d, d, hv, 1
        )
        res = ggml.ggml_gated_delta_net(ctx, q, k, v, g, beta, s0, 1)  # [d hv, T + d]: o, S
        o = ggml.ggml_view_4d(ctx, res, d, hv, T, 1, d * f, d * hv * f, d * hv * T * f, 0)
        self.b.effects.append(
            ggml.ggml_set_rows(
                ctx,
                states.delta[layer],
                ggml.ggml_view_2d(ctx, res, hp.delta_state, 1, hp.delta_state * f, d * hv * T * f),
                self.state_row,
            )
        )
        out = ggml.ggml_mul(ctx, self.norm(o, p + "ssm_norm.weight"), ggml.ggml_silu(ctx, z))
        return self.mm(p + "ssm_out.weight", ggml.ggml_reshape_2d(ctx, out, d * hv, T))

    def attend(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        scale: float,
        mask: Callable[[int], Tensor],
    ) -> Tensor:
        """Write k, v to the pool, gather the sessions' pages, softmax(scale·qK^T + mask) V
        (a sliding-window layer in the window pool: its ring's pages, `mask` over them;
        `mask(group)` is a group's).

        The products are llama.cpp's: K and V^T in the cache's precision, so with an F16
        cache q and the attention weights are rounded to F16 inside the matmuls exactly as
        llama.cpp rounds them. V is stored transposed per page (kv/pool.py), so the gathered
        V^T is a copy of whole 64-slot rows rather than an element-wise transpose, which
        cost a large share of a decode step (see bench/bench_compute.py).

        With several sequences each attends over its own pages alone (the products of a
        group's sequences are batched over the fourth dimension), so the cost grows with
        the sequences' own contexts and rows, not with their product as one mask over
        everyone's slots and rows would.
        """
        hp, ctx, T, pool = self.hp, self.ctx, self.T, self.kv
        assert pool is not None
        slots, v_slots, kv_pages, n_kv = (
            (self.swa_slots, self.swa_v_slots, self.swa_pages, self.n_kv_swa)
            if layer in pool.window_layers
            else (self.slots, self.v_slots, self.kv_pages, self.n_kv)
        )
        dtype = int(pool.k[layer].contents.type)
        # set_rows returns a view of the cache: reading through it orders the gather after it
        k_all = ggml.ggml_set_rows(
            ctx, pool.k[layer], ggml.ggml_reshape_2d(ctx, k, hp.kv_dim, T), slots
        )
        v_all = ggml.ggml_set_rows(
            ctx, pool.v_flat(ctx, layer), ggml.ggml_reshape_2d(ctx, v, 1, hp.kv_dim * T), v_slots
        )
        S, d = self.seqs, hp.head_dim
        pages, held = n_kv // PAGE, pool.pages(layer)
        # Gathered as bytes: a 16-bit cache's values two to an I32 (get_rows would widen
        # them to F32, and a cast narrow them back: three passes over the session's KV per
        # layer instead of one; see bench/bench_scale.py --only prefill).
        pair = ggml.ggml_type_size(dtype) == 2
        word = I32 if pair else dtype
        per = 2 if pair else 1  # values per word
        kk = ggml.ggml_get_rows(
            ctx, _as(ctx, ggml.ggml_reshape_2d(ctx, k_all, hp.kv_dim * PAGE, held), word), kv_pages
        )  # [kv_dim PAGE, pages S]
        vv = ggml.ggml_get_rows(
            ctx, _as(ctx, ggml.ggml_reshape_2d(ctx, v_all, hp.kv_dim * PAGE, held), word), kv_pages
        )
        vv = ggml.ggml_permute(
            ctx, ggml.ggml_reshape_4d(ctx, vv, PAGE // per, hp.kv_dim, pages, S), 0, 2, 1, 3
        )
        vt = ggml.ggml_cpy(
            ctx, vv, ggml.ggml_new_tensor_4d(ctx, word, PAGE // per, pages, hp.kv_dim, S)
        )
        kk, vt = _as(ctx, kk, dtype), _as(ctx, vt, dtype)  # [PAGE, pages, kv_dim, S]
        vt = ggml.ggml_reshape_4d(ctx, vt, n_kv, d, hp.n_head_kv, S)  # V^T per KV head
        kk = ggml.ggml_reshape_4d(ctx, kk, d, hp.n_head_kv, n_kv, S)
        sinks = f"blk.{layer}.attn_sinks.weight"
        outs, row, seq = [], 0, 0
        for g, (R, n) in enumerate(self.groups):
            kk_g, vt_g = (_seqs(ctx, t, seq, n) for t in (kk, vt))
            q_g = ggml.ggml_view_3d(
                ctx,
                q,
                d,
                hp.n_head,
                R * n,
                int(q.contents.nb[1]),
                int(q.contents.nb[2]),
                row * int(q.contents.nb[2]),
            )
            qq = ggml.ggml_permute(
                ctx, ggml.ggml_reshape_4d(ctx, q_g, d, hp.n_head, R, n), 0, 2, 1, 3
            )  # [d, R, h, n]
            kq = ggml.ggml_mul_mat(ctx, ggml.ggml_permute(ctx, kk_g, 0, 2, 1, 3), qq)
            kq = ggml.ggml_soft_max_ext(ctx, kq, mask(g), scale, 0.0)  # [n_kv, R, h, n]
            if self.w.has(sinks):  # a learned per-head logit in each softmax, its weight dropped
                ggml.ggml_soft_max_add_sinks(kq, self.t(sinks))
            kqv = ggml.ggml_mul_mat(ctx, vt_g, kq)  # [d, R, h, n]
            merged = ggml.ggml_permute(ctx, kqv, 0, 2, 1, 3)  # [d, h, R, n]
            outs.append(ggml.ggml_cont_2d(ctx, merged, d * hp.n_head, R * n))
            row, seq = row + R * n, seq + n
        out = outs[0]
        for more in outs[1:]:
            out = ggml.ggml_concat(ctx, out, more, 1)
        return out

    def swiglu_ffn(self, layer: int, x: Tensor) -> Tensor:
        """x + down(silu(gate(norm x)) * up(norm x)): the dense llama FFN."""
        cur = self.norm(x, f"blk.{layer}.ffn_norm.weight")
        return ggml.ggml_add(self.ctx, x, self.ffn(layer, cur, SWIGLU))

    def ffn(self, layer: int, cur: Tensor, glu: Callable[..., Tensor], kind: str = "") -> Tensor:
        """down(glu(gate cur, up cur)), no norm, no residual; `kind` "_shexp" is the shared
        expert's."""
        p = f"blk.{layer}."
        gate = self.mm(p + f"ffn_gate{kind}.weight", cur)
        up = self.mm(p + f"ffn_up{kind}.weight", cur)
        return self.mm(p + f"ffn_down{kind}.weight", glu(self.ctx, gate, up))

    def shared_expert(self, layer: int, cur: Tensor) -> Tensor:
        """The shared expert's SwiGLU FFN scaled by sigmoid(ffn_gate_inp_shexp · cur)."""
        gate = self.mm(f"blk.{layer}.ffn_gate_inp_shexp.weight", cur)  # [1, T]
        return ggml.ggml_mul(
            self.ctx, self.ffn(layer, cur, SWIGLU, "_shexp"), ggml.ggml_sigmoid(self.ctx, gate)
        )

    def router(
        self,
        layer: int,
        x: Tensor,
        normalise: bool,
        norm: str = "ffn_norm.weight",
        shared: bool = False,
        softmax_after: bool = False,
    ) -> RouterOut:
        """Router authority: softmax over all experts, top-k, optionally renormalise the k
        (`softmax_after`: top-k of the logits, then softmax over the k); the FFN input is
        x normed by `norm`; with `shared`, the shared expert runs here too."""
        hp, ctx, p, T = self.hp, self.ctx, f"blk.{layer}.", int(x.contents.ne[1])
        cur = self.norm(x, p + norm)
        logits = self.linear(p + "ffn_gate_inp", cur)  # [n_exp, T]
        probs = logits if softmax_after else ggml.ggml_soft_max(ctx, logits)
        ids = ggml.ggml_argsort_top_k(ctx, probs, hp.n_expert_used)  # [k, T]
        w = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, probs, 1, hp.n_expert, T), ids)
        w = ggml.ggml_reshape_2d(ctx, w, hp.n_expert_used, T)
        if softmax_after:
            w = ggml.ggml_soft_max(ctx, w)
        if normalise:
            w = ggml.ggml_div(ctx, w, ggml.ggml_sum_rows(ctx, w))
        return RouterOut(
            resid=x,
            cur=cur,
            ids=ids,
            weights=w,
            shared=self.shared_expert(layer, cur) if shared else None,
        )

    def experts(self, layer: int, cur: Tensor, ids: Tensor) -> Tensor:
        """Per (token, slot) expert FFN outputs [n_embd, k, T] for local ids [k, T]: each
        projection plus its expert's bias where the model has them, SwiGLU (clamped where
        the model clamps it)."""
        p, ctx, T = f"blk.{layer}.", self.ctx, int(cur.contents.ne[1])
        x3 = ggml.ggml_reshape_3d(ctx, cur, int(cur.contents.ne[0]), 1, T)

        def project(kind: str, x: Tensor) -> Tensor:
            out = ggml.ggml_mul_mat_id(ctx, self.t(p + f"ffn_{kind}_exps.weight"), x, ids)
            if not self.hp.expert_biases:
                return out
            return ggml.ggml_add_id(ctx, out, self.t(p + f"ffn_{kind}_exps.bias"), ids)

        gate, up = project("gate", x3), project("up", x3)
        limit = self.hp.swiglu_limit
        act = (
            ggml.ggml_swiglu_oai(ctx, gate, up, SWIGLU_ALPHA, limit)
            if limit
            else ggml.ggml_swiglu_split(ctx, gate, up)
        )
        return project("down", act)

    def combine(self, r: RouterOut, outs: Tensor) -> Tensor:
        """resid + (sum_k weight_k * expert_k [+ shared]), summed in slot order (as
        `combine_rows` does)."""
        ctx, k, T = self.ctx, self.hp.n_expert_used, int(r.resid.contents.ne[1])
        weighted = ggml.ggml_mul(ctx, outs, ggml.ggml_reshape_3d(ctx, r.weights, 1, k, T))
        c = weighted.contents
        n_embd, nb1, nb2 = int(c.ne[0]), int(c.nb[1]), int(c.nb[2])
        total = None
        for j in range(k):
            part = ggml.ggml_view_2d(ctx, weighted, n_embd, T, nb2, j * nb1)
            total = part if total is None else ggml.ggml_add(ctx, total, part)
        if r.shared is not None:
            total = ggml.ggml_add(ctx, total, r.shared)
        return ggml.ggml_add(ctx, r.resid, total)

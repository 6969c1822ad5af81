"""gpt-oss (llama.cpp's "gpt-oss"): NEOX RoPE with YaRN scaling, biased Q/K/V/O
projections, attention sinks (a learned per-head logit in every softmax, its weight
dropped), layers alternating between a sliding window and full attention (even layers
windowed, unless the file says; they keep only their window of KV, in a ring of pages:
kv/window.py), routed experts with biases and the clamped SwiGLU.

Routing as llama.cpp's SOFTMAX_WEIGHT gating: the router's biased logits, top-k of them,
then a softmax over the k. The FFN reads the post-attention norm (gpt-oss has no
ffn_norm). Experts are stored in MXFP4 by released files: an expert's slab is whole
32-value blocks, so a range is still a byte copy.
"""

from __future__ import annotations

from kvasird.compute.arch import Architecture, routed_layer
from kvasird.compute.blocks import ROPE_NEOX, Blocks, RouterOut
from kvasird.compute.graph import Tensor, ggml


def _dense(b: Blocks, layer: int, x: Tensor) -> RouterOut:
    attn = b.self_attention(
        layer, b.norm(x, f"blk.{layer}.attn_norm.weight"), ROPE_NEOX, qk_norm=False
    )
    x = b.mixed(layer, ggml.ggml_add(b.ctx, attn, x))
    return b.router(
        layer, x, normalise=False, norm="post_attention_norm.weight", softmax_after=True
    )


ARCH = Architecture(
    name="gpt-oss",
    dense_tensors=(
        "attn_norm.weight",
        "attn_q.weight",
        "attn_q.bias",
        "attn_k.weight",
        "attn_k.bias",
        "attn_v.weight",
        "attn_v.bias",
        "attn_output.weight",
        "attn_output.bias",
        "attn_sinks.weight",
        "post_attention_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_inp.bias",
    ),
    expert_tensors=(
        "ffn_gate_exps.weight",
        "ffn_gate_exps.bias",
        "ffn_up_exps.weight",
        "ffn_up_exps.bias",
        "ffn_down_exps.weight",
        "ffn_down_exps.bias",
    ),
    layer=routed_layer(_dense),
    dense=_dense,
)

"""qwen35 (dense Qwen3.5): gated delta-net layers with a full-attention layer every
`full_attention_interval`, each followed by a dense SwiGLU FFN on the post-attention norm.

The attention layers project each head's query and an output gate together (the gate's
sigmoid scales the attention output), norm Q and K per head, and rotate the first n_rot
dimensions with multi-section RoPE. The delta-net layers' recurrent state lives with the
session (kv/recurrent.py); `Blocks.delta_net` has their math.
"""

from __future__ import annotations

from kvasird.compute.arch import Architecture
from kvasird.compute.blocks import SWIGLU, Blocks
from kvasird.compute.graph import Tensor, ggml

ATTENTION = (
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "attn_output.weight",
)
"""A full-attention layer's own tensors (attn_q holds each head's query and gate)."""
DELTA_NET = (
    "attn_qkv.weight",
    "attn_gate.weight",
    "ssm_conv1d.weight",
    "ssm_dt.bias",
    "ssm_a",
    "ssm_beta.weight",
    "ssm_alpha.weight",
    "ssm_norm.weight",
    "ssm_out.weight",
)
"""A delta-net layer's own tensors."""


def mixer(b: Blocks, layer: int, x: Tensor) -> Tensor:
    """x + the layer's token mixing (delta-net or gated attention) of norm(x)."""
    cur = b.norm(x, f"blk.{layer}.attn_norm.weight")
    mixed = b.delta_net(layer, cur) if b.hp.is_recurrent(layer) else b.gated_attention(layer, cur)
    return b.mixed(layer, ggml.ggml_add(b.ctx, mixed, x))


def _layer(b: Blocks, layer: int, x: Tensor) -> Tensor:
    x = mixer(b, layer, x)
    ffn = b.ffn(layer, b.norm(x, f"blk.{layer}.post_attention_norm.weight"), SWIGLU)
    return ggml.ggml_add(b.ctx, ffn, x)


ARCH = Architecture(
    name="qwen35",
    dense_tensors=(
        "attn_norm.weight",
        "post_attention_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ),
    expert_tensors=(),
    layer=_layer,
    attention_tensors=ATTENTION,
    recurrent_tensors=DELTA_NET,
)

"""gemma3: the embedding scaled by sqrt(n_embd); per-head Q/K norms, NEOX RoPE, q scaled
before the product; norms after attention and after the FFN as well as before; GeGLU FFN.

Layers alternate between a sliding window (with their own RoPE base) and global
attention in llama.cpp's pattern (hparams: every sixth layer global unless the file says).
The windowed layers keep only their window of KV, in a ring of pages (kv/window.py).
"""

from __future__ import annotations

from kvasird.compute.arch import Architecture
from kvasird.compute.blocks import GEGLU, ROPE_NEOX, Blocks
from kvasird.compute.graph import Tensor, ggml


def _layer(b: Blocks, layer: int, x: Tensor) -> Tensor:
    p = f"blk.{layer}."
    attn = b.self_attention(
        layer, b.norm(x, p + "attn_norm.weight"), ROPE_NEOX, qk_norm=True, scale_q=True
    )
    x = b.mixed(layer, ggml.ggml_add(b.ctx, b.norm(attn, p + "post_attention_norm.weight"), x))
    ffn = b.ffn(layer, b.norm(x, p + "ffn_norm.weight"), GEGLU)
    return ggml.ggml_add(b.ctx, b.norm(ffn, p + "post_ffw_norm.weight"), x)


ARCH = Architecture(
    name="gemma3",
    dense_tensors=(
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_q_norm.weight",
        "attn_k_norm.weight",
        "attn_output.weight",
        "post_attention_norm.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
        "post_ffw_norm.weight",
    ),
    expert_tensors=(),
    layer=_layer,
    scaled_embedding=True,
)

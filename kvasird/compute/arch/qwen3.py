"""qwen3 (dense Qwen3): per-head Q/K RMS norms before NEOX RoPE, dense SwiGLU FFN."""

from __future__ import annotations

from kvasird.compute.arch import Architecture
from kvasird.compute.blocks import ROPE_NEOX, Blocks
from kvasird.compute.graph import Tensor


def _layer(b: Blocks, layer: int, x: Tensor) -> Tensor:
    x = b.attention(layer, x, ROPE_NEOX, qk_norm=True)
    return b.swiglu_ffn(layer, x)


ARCH = Architecture(
    name="qwen3",
    dense_tensors=(
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_q_norm.weight",
        "attn_k_norm.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ),
    expert_tensors=(),
    layer=_layer,
)

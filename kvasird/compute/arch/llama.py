"""llama (SmolLM2, Llama 2/3): pre-norm attention with normal RoPE, dense SwiGLU FFN."""

from __future__ import annotations

from kvasird.compute.arch import Architecture
from kvasird.compute.blocks import ROPE_NORMAL, Blocks
from kvasird.compute.graph import Tensor


def _layer(b: Blocks, layer: int, x: Tensor) -> Tensor:
    x = b.attention(layer, x, ROPE_NORMAL, qk_norm=False)
    return b.swiglu_ffn(layer, x)


ARCH = Architecture(
    name="llama",
    dense_tensors=(
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ),
    expert_tensors=(),
    layer=_layer,
)

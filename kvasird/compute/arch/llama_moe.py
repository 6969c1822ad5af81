"""llama with experts (Mixtral): llama's attention (normal RoPE, no Q/K norms), routed
SwiGLU experts in place of the dense FFN.

Routing as llama.cpp's `build_moe_ffn` for LLM_ARCH_LLAMA: softmax over all experts,
top-k, the k weights renormalised to sum 1. The experts' hidden size is llama's
`feed_forward_length` (there is no expert_feed_forward_length for llama).
"""

from __future__ import annotations

from kvasird.compute.arch import Architecture, routed_layer
from kvasird.compute.blocks import ROPE_NORMAL, Blocks, RouterOut
from kvasird.compute.graph import Tensor


def _dense(b: Blocks, layer: int, x: Tensor) -> RouterOut:
    x = b.attention(layer, x, ROPE_NORMAL, qk_norm=False)
    return b.router(layer, x, normalise=True)


ARCH = Architecture(
    name="llama",
    dense_tensors=(
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate_inp.weight",
    ),
    expert_tensors=("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"),
    layer=routed_layer(_dense),
    dense=_dense,
)

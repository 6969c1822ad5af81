"""qwen3moe (Qwen3-30B-A3B family): per-head Q/K RMS norms, NEOX RoPE, routed SwiGLU experts.

Routing: softmax over all experts, top-k, then the k weights renormalised to sum 1.
"""

from __future__ import annotations

from kvasird.compute.arch import Architecture, routed_layer
from kvasird.compute.blocks import ROPE_NEOX, Blocks, RouterOut
from kvasird.compute.graph import Tensor


def _dense(b: Blocks, layer: int, x: Tensor) -> RouterOut:
    x = b.attention(layer, x, ROPE_NEOX, qk_norm=True)
    return b.router(layer, x, normalise=True)


ARCH = Architecture(
    name="qwen3moe",
    dense_tensors=(
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_q_norm.weight",
        "attn_k_norm.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate_inp.weight",
    ),
    expert_tensors=("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"),
    layer=routed_layer(_dense),
    dense=_dense,
)

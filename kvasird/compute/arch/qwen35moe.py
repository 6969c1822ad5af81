"""qwen35moe (Qwen3.5/3.6 MoE, the seeds' flagship): qwen35's delta-net and gated-attention
layers, then routed SwiGLU experts beside a shared expert on the post-attention norm.

Routing as qwen3moe's (softmax over all experts, top-k, the k weights renormalised). The
shared expert is computed with the dense path, scaled by sigmoid(ffn_gate_inp_shexp · x),
and added to the routed experts' sum before the residual, as llama.cpp adds it.
"""

from __future__ import annotations

from kvasird.compute.arch import Architecture, routed_layer
from kvasird.compute.arch.qwen35 import ATTENTION, DELTA_NET, mixer
from kvasird.compute.blocks import Blocks, RouterOut
from kvasird.compute.graph import Tensor


def _dense(b: Blocks, layer: int, x: Tensor) -> RouterOut:
    return b.router(
        layer, mixer(b, layer, x), normalise=True, norm="post_attention_norm.weight", shared=True
    )


ARCH = Architecture(
    name="qwen35moe",
    dense_tensors=(
        "attn_norm.weight",
        "post_attention_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_inp_shexp.weight",
        "ffn_gate_shexp.weight",
        "ffn_up_shexp.weight",
        "ffn_down_shexp.weight",
    ),
    expert_tensors=("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"),
    layer=routed_layer(_dense),
    dense=_dense,
    attention_tensors=ATTENTION,
    recurrent_tensors=DELTA_NET,
)

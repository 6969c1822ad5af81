"""A model's hyper-parameters, read from GGUF metadata under the architecture's key prefix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from kvasird.compute.errors import WeightsError
from kvasird.compute.ggufview import ArrayLen, GGUFFile

DEFAULT_CONTEXT = 4096
"""The trained context taken for a model whose GGUF does not say."""


@dataclass(frozen=True)
class HParams:
    """The numbers every graph and every validation depends on."""

    arch: str
    """llama.cpp architecture name ("llama", "qwen3", "qwen3moe", "gemma3", "qwen35",
    "qwen35moe", "gpt-oss"); "llama" with experts is Mixtral's layout
    (compute.arch.for_hparams tells them apart)."""
    n_layer: int
    """Transformer blocks in the whole model (not only those held), without the draft
    (multi-token prediction) blocks some files append."""
    n_embd: int
    """Hidden size."""
    n_head: int
    """Query heads."""
    n_head_kv: int
    """Key/value heads."""
    head_dim: int
    """Per-head size of queries and keys (= of values for the supported archs)."""
    n_vocab: int
    """Vocabulary size; 0 when a slice without head or tokenizer cannot tell (not needed then)."""
    n_ff: int
    """Dense FFN size (0 when unused)."""
    n_expert: int
    """Experts per MoE layer (0 for dense models)."""
    n_expert_used: int
    """Experts routed per token (top-k)."""
    n_ff_exp: int
    """Hidden size of one expert FFN (llama with experts: its feed_forward_length, the
    only size llama.cpp reads for it)."""
    rope_base: float
    """RoPE frequency base."""
    rms_eps: float
    """RMS-norm epsilon."""
    n_ctx_train: int
    """Context length the model was trained for."""
    n_swa: int = 0
    """Sliding window of the layers that have one: a query sees the n_swa newest positions
    up to its own (0: no layer has a window)."""
    swa_layers: tuple[bool, ...] = ()
    """Per layer, whether it attends through the sliding window (empty: none does)."""
    rope_base_swa: float = 10000.0
    """RoPE frequency base of the sliding-window layers."""
    attn_scale: float = 0.0
    """Scale of q·k (0: 1/sqrt(head_dim))."""
    logit_softcap: float = 0.0
    """Final logits become c·tanh(logits/c) (0: not capped)."""
    n_rot: int = 0
    """Dimensions of each head RoPE rotates, the first n_rot (0: the whole head)."""
    rope_sections: tuple[int, ...] = ()
    """Multi-section RoPE's four section sizes in rotated pairs (empty: one-section RoPE)."""
    recurrent_layers: tuple[bool, ...] = ()
    """Per layer, whether it is a gated delta-net (linear attention with a recurrent state)
    instead of attention (empty: none is)."""
    ssm_conv: int = 0
    """Delta-net layers: width of the causal depthwise convolution over q, k, v."""
    ssm_head_dim: int = 0
    """Delta-net layers: size of a key head and of a value head."""
    ssm_k_heads: int = 0
    """Delta-net layers: key (and query) heads."""
    ssm_v_heads: int = 0
    """Delta-net layers: value heads, a multiple of the key heads (value head j reads key
    head j mod ssm_k_heads)."""
    n_ff_shexp: int = 0
    """Hidden size of the shared expert beside the routed ones (0: no shared expert)."""
    rope_scale: float = 1.0
    """RoPE frequency scale, 1 / rope.scaling.factor (linear or YaRN scaling; 1: none)."""
    rope_scale_swa: float = 1.0
    """RoPE frequency scale of the sliding-window layers."""
    yarn_ext: float = 0.0
    """YaRN's extrapolation mix (1 with YaRN scaling, 0 without)."""
    yarn_attn: float = 1.0
    """YaRN's magnitude factor as llama.cpp passes it to RoPE (ggml scales it again)."""
    n_ctx_orig: int = 0
    """Context RoPE's YaRN corrections are computed for (0: n_ctx_train)."""
    swiglu_limit: float = 0.0
    """The experts' clamped SwiGLU (gpt-oss): gate clamped above and up within this limit,
    gate·sigmoid(1.702·gate)·(up + 1) (0: plain SwiGLU)."""
    expert_biases: bool = False
    """The experts' projections have biases (gpt-oss): experts loaded without them are
    refused when their graph is built, never computed without."""

    @property
    def rope_ctx(self) -> int:
        return self.n_ctx_orig or self.n_ctx_train

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def rot_dims(self) -> int:
        return self.n_rot or self.head_dim

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def conv_channels(self) -> int:
        """Channels the delta-net convolution runs over: q, k and v side by side."""
        return self.ssm_head_dim * (2 * self.ssm_k_heads + self.ssm_v_heads)

    @property
    def conv_state(self) -> int:
        """Floats of one delta-net layer's convolution state: the last ssm_conv - 1 inputs."""
        return (self.ssm_conv - 1) * self.conv_channels

    @property
    def delta_state(self) -> int:
        """Floats of one delta-net layer's recurrent state: a d x d matrix per value head."""
        return self.ssm_head_dim * self.ssm_head_dim * self.ssm_v_heads

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> HParams:
        arch = f.require("general.architecture")
        k = f"{arch}."
        n_embd = int(f.require(k + "embedding_length"))
        n_head = int(f.require(k + "attention.head_count"))
        n_head_kv = int(f.get(k + "attention.head_count_kv", n_head))
        if n_embd < 1 or n_head < 1 or n_head_kv < 1:
            raise WeightsError(
                f"{f.path}: embedding_length {n_embd}, head_count {n_head} and "
                f"head_count_kv {n_head_kv} must be positive: the file is "
                "damaged or was converted wrongly"
            )
        # the trunk: multi-token-prediction blocks after it are llama.cpp's draft head, not layers
        n_layer = int(f.require(k + "block_count")) - int(f.get(k + "nextn_predict_layers", 0))
        n_ff = int(f.get(k + "feed_forward_length", 0))
        n_expert = int(f.get(k + "expert_count", 0))
        n_vocab = f.get(k + "vocab_size") or f.get("tokenizer.ggml.tokens") or 0
        if not n_vocab and "token_embd.weight" in f.tensors:
            n_vocab = f.tensors["token_embd.weight"].ne[1]
        hp = cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=int(f.get(k + "attention.key_length", n_embd // n_head)),
            n_vocab=int(n_vocab),
            n_ff=n_ff,
            n_expert=n_expert,
            n_expert_used=int(f.get(k + "expert_used_count", 0)),
            n_ff_exp=n_ff
            if arch == "llama" and n_expert
            else int(f.get(k + "expert_feed_forward_length", 0)),
            rope_base=float(f.get(k + "rope.freq_base", 10000.0)),
            rms_eps=float(f.require(k + "attention.layer_norm_rms_epsilon")),
            n_ctx_train=int(f.get(k + "context_length", DEFAULT_CONTEXT)),
            **_windows(f, arch, n_layer),
            attn_scale=_attn_scale(arch, n_embd, n_head, n_layer),
            logit_softcap=float(f.get(k + "final_logit_softcapping", 0.0)),
            n_rot=int(f.get(k + "rope.dimension_count", 0)),
            **_delta_net(f, arch, n_layer),
            **_rope_scaling(f, arch),
            swiglu_limit=7.0 if arch == "gpt-oss" else 0.0,
            expert_biases=arch == "gpt-oss",
        )
        value_len = int(f.get(k + "attention.value_length", hp.head_dim))
        n_rot = hp.rot_dims
        if n_rot != hp.head_dim and (arch not in HYBRID or n_rot > hp.head_dim or n_rot % 2):
            raise WeightsError(
                f"{f.path}: RoPE over {n_rot} of {hp.head_dim} head dimensions "
                "(partial rotary) is not supported"
            )
        if hp.rope_sections and not 0 < sum(hp.rope_sections) <= hp.head_dim:
            raise WeightsError(
                f"{f.path}: RoPE sections {list(hp.rope_sections)} do not fit a "
                f"head of {hp.head_dim}"
            )  # ggml would abort on them
        if value_len != hp.head_dim or hp.n_head % hp.n_head_kv:
            raise WeightsError(
                f"{f.path}: unsupported head layout (value_length {value_len}, "
                f"heads {hp.n_head}/{hp.n_head_kv})"
            )
        if hp.is_moe and not 0 < hp.n_expert_used <= hp.n_expert:
            raise WeightsError(
                f"{f.path}: expert_used_count {hp.n_expert_used} is not in 1..{hp.n_expert}"
            )
        return hp


HYBRID = ("qwen35", "qwen35moe")
"""Architectures of gated delta-net layers beside full-attention ones (llama.cpp's Qwen3.5),
whose attention rotates part of each head with multi-section RoPE."""


class _DeltaNet(TypedDict, total=False):
    """The hybrid's fields of HParams (none for another architecture)."""

    rope_sections: tuple[int, ...]
    recurrent_layers: tuple[bool, ...]
    ssm_conv: int
    ssm_head_dim: int
    ssm_k_heads: int
    ssm_v_heads: int
    n_ff_shexp: int


def _delta_net(f: GGUFFile, arch: str, n_layer: int) -> _DeltaNet:
    """The hybrid's hparams as llama.cpp reads them: every full_attention_interval-th layer
    (the last of each interval) attends, the others are delta-nets, unless the file lists
    them (attention.recurrent_layers)."""
    if arch not in HYBRID:
        return {}
    k = f"{arch}."
    listed = f.numbers(k + "attention.recurrent_layers")
    if listed is None:
        every = int(f.get(k + "full_attention_interval", 4))
        layers = tuple((i + 1) % every != 0 for i in range(n_layer))
    else:
        layers = tuple(bool(x) for x in listed[:n_layer])
    sections = f.numbers(k + "rope.dimension_sections")
    if sections is None:
        raise WeightsError(f"{f.path} lacks metadata key {k + 'rope.dimension_sections'!r}")
    d_state, d_inner, k_heads, v_heads = (
        int(f.require(k + "ssm." + key))
        for key in ("state_size", "inner_size", "group_count", "time_step_rank")
    )
    if d_inner != d_state * v_heads or not k_heads or v_heads % k_heads:
        raise WeightsError(
            f"{f.path}: unsupported delta-net layout (inner size {d_inner}, state "
            f"size {d_state}, value heads {v_heads}, key heads {k_heads})"
        )
    n_ff = int(f.get(k + "feed_forward_length", 0))
    return {
        "rope_sections": tuple(int(x) for x in (tuple(sections) + (0, 0, 0, 0))[:4]),
        "recurrent_layers": layers,
        "ssm_conv": int(f.require(k + "ssm.conv_kernel")),
        "ssm_head_dim": d_state,
        "ssm_k_heads": k_heads,
        "ssm_v_heads": v_heads,
        "n_ff_shexp": int(f.get(k + "expert_shared_feed_forward_length", n_ff))
        if arch == "qwen35moe"
        else 0,
    }


_SWA_PATTERN = {"gemma3": 6, "gpt-oss": 2}
"""llama.cpp's default sliding-window pattern per architecture, when the file has none:
every n-th layer (the last of each n) attends globally, the others through the window."""


class _Windows(TypedDict, total=False):
    """The sliding-window fields of HParams (none where no layer slides)."""

    n_swa: int
    swa_layers: tuple[bool, ...]
    rope_base_swa: float


def _windows(f: GGUFFile, arch: str, n_layer: int) -> _Windows:
    """Sliding-window hparams as llama.cpp reads them (load_swa_pattern)."""
    k = f"{arch}."
    n_swa = int(f.get(k + "attention.sliding_window", 0) or 0)
    if arch not in _SWA_PATTERN or n_swa <= 0:
        return {}
    n = f.get(k + "attention.sliding_window_pattern", _SWA_PATTERN[arch])
    if isinstance(n, ArrayLen):
        raise WeightsError(
            f"{f.path}: a per-layer sliding_window_pattern array is not "
            "supported (only llama.cpp's every-n-th-layer-global pattern)"
        )
    layers = tuple(n == 0 or i % n < n - 1 for i in range(n_layer))
    # gpt-oss's windowed layers rotate as the others unless the file says
    base = float(f.get(k + "rope.freq_base", 10000.0)) if arch == "gpt-oss" else 10000.0
    return {
        "n_swa": n_swa,
        "swa_layers": layers,
        "rope_base_swa": float(f.get(k + "rope.freq_base_swa", base)),
    }


class _RopeScaling(TypedDict):
    """The RoPE-scaling fields of HParams."""

    rope_scale: float
    rope_scale_swa: float
    yarn_ext: float
    yarn_attn: float
    n_ctx_orig: int


def _rope_scaling(f: GGUFFile, arch: str) -> _RopeScaling:
    """RoPE scaling as llama.cpp sets it up for a context: the frequency scale from
    rope.scaling.factor, and with YaRN the extrapolation mix and the magnitude factor,
    computed in float32 as llama.cpp computes them (its YaRN factor cancels ggml's)."""
    k = f"{arch}."
    kind = str(f.get(k + "rope.scaling.type", "linear"))
    if kind not in ("none", "linear", "yarn"):
        raise WeightsError(
            f"{f.path}: RoPE scaling {kind!r} is not supported (only none, linear and yarn)"
        )
    factor = float(f.get(k + "rope.scaling.factor", 0.0) or 0.0)
    scale = 1.0 if kind == "none" or factor == 0.0 else float(np.float32(1) / np.float32(factor))
    attn = np.float32(1)
    if kind == "yarn":
        ln = np.log(np.float32(1) / np.float32(scale), dtype=np.float32)
        mscale = np.float32(0.1) * ln + np.float32(1) if scale < 1.0 else np.float32(1)
        attn = np.float32(mscale * (np.float32(1) / (np.float32(1) + np.float32(0.1) * ln)))
    attn = np.float32(attn * np.float32(f.get(k + "rope.scaling.attn_factor", 1.0)))
    return {
        "rope_scale": scale,
        "rope_scale_swa": scale if arch == "gpt-oss" else 1.0,
        "yarn_ext": 1.0 if kind == "yarn" else 0.0,
        "yarn_attn": float(attn),
        "n_ctx_orig": int(f.get(k + "rope.scaling.original_context_length", 0)),
    }


def _attn_scale(arch: str, n_embd: int, n_head: int, n_layer: int) -> float:
    """gemma3 27B (62 layers) scales q·k by its query_pre_attn_scalar, n_embd / n_head."""
    return (n_embd / n_head) ** -0.5 if arch == "gemma3" and n_layer == 62 else 0.0

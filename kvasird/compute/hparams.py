"""A model's hyper-parameters, read from GGUF metadata under the architecture's key prefix."""

from __future__ import annotations

from dataclasses import dataclass

from kvasird.compute.errors import WeightsError
from kvasird.compute.ggufview import ArrayLen, GGUFFile


@dataclass(frozen=True)
class HParams:
    """The numbers every graph and every validation depends on."""

    arch: str
    """llama.cpp architecture name ("llama", "qwen3", "qwen3moe"); "llama" with experts
    is Mixtral's layout (compute.arch.for_hparams tells them apart)."""
    n_layer: int
    """Transformer blocks in the whole model (not only those held)."""
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

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

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
        n_layer = int(f.require(k + "block_count"))
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
            n_head_kv=int(f.get(k + "attention.head_count_kv", n_head)),
            head_dim=int(f.get(k + "attention.key_length", n_embd // n_head)),
            n_vocab=int(n_vocab),
            n_ff=n_ff,
            n_expert=n_expert,
            n_expert_used=int(f.get(k + "expert_used_count", 0)),
            n_ff_exp=n_ff if arch == "llama" and n_expert else
            int(f.get(k + "expert_feed_forward_length", 0)),
            rope_base=float(f.get(k + "rope.freq_base", 10000.0)),
            rms_eps=float(f.require(k + "attention.layer_norm_rms_epsilon")),
            n_ctx_train=int(f.get(k + "context_length", 4096)),
            **_windows(f, arch, n_layer),
            attn_scale=_attn_scale(arch, n_embd, n_head, n_layer),
            logit_softcap=float(f.get(k + "final_logit_softcapping", 0.0)),
        )
        value_len = int(f.get(k + "attention.value_length", hp.head_dim))
        n_rot = int(f.get(k + "rope.dimension_count", hp.head_dim))
        if n_rot != hp.head_dim:
            raise WeightsError(f"{f.path}: RoPE over {n_rot} of {hp.head_dim} head dimensions "
                               "(partial rotary) is not supported")
        if value_len != hp.head_dim or hp.n_head % hp.n_head_kv:
            raise WeightsError(f"{f.path}: unsupported head layout (value_length {value_len}, "
                               f"heads {hp.n_head}/{hp.n_head_kv})")
        if hp.is_moe and not 0 < hp.n_expert_used <= hp.n_expert:
            raise WeightsError(f"{f.path}: expert_used_count {hp.n_expert_used} is not in "
                               f"1..{hp.n_expert}")
        return hp


_SWA_PATTERN = {"gemma3": 6}
"""llama.cpp's default sliding-window pattern per architecture, when the file has none:
every n-th layer (the last of each n) attends globally, the others through the window."""


def _windows(f: GGUFFile, arch: str, n_layer: int) -> dict[str, object]:
    """Sliding-window hparams as llama.cpp reads them (load_swa_pattern)."""
    k = f"{arch}."
    n_swa = int(f.get(k + "attention.sliding_window", 0) or 0)
    if arch not in _SWA_PATTERN or n_swa <= 0:
        return {}
    n = f.get(k + "attention.sliding_window_pattern", _SWA_PATTERN[arch])
    if isinstance(n, ArrayLen):
        raise WeightsError(f"{f.path}: a per-layer sliding_window_pattern array is not "
                           "supported (only llama.cpp's every-n-th-layer-global pattern)")
    layers = tuple(n == 0 or i % n < n - 1 for i in range(n_layer))
    return {"n_swa": n_swa, "swa_layers": layers,
            "rope_base_swa": float(f.get(k + "rope.freq_base_swa", 10000.0))}


def _attn_scale(arch: str, n_embd: int, n_head: int, n_layer: int) -> float:
    """gemma3 27B (62 layers) scales q·k by its query_pre_attn_scalar, n_embd / n_head."""
    return (n_embd / n_head) ** -0.5 if arch == "gemma3" and n_layer == 62 else 0.0

"""A model's hyper-parameters, read from GGUF metadata under the architecture's key prefix."""

from __future__ import annotations

from dataclasses import dataclass

from kvasird.compute.errors import WeightsError
from kvasird.compute.ggufview import GGUFFile


@dataclass(frozen=True)
class HParams:
    """The numbers every graph and every validation depends on."""

    arch: str
    """llama.cpp architecture name ("llama", "qwen3moe")."""
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
    """Hidden size of one expert FFN."""
    rope_base: float
    """RoPE frequency base."""
    rms_eps: float
    """RMS-norm epsilon."""
    n_ctx_train: int
    """Context length the model was trained for."""

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> HParams:
        arch = f.require("general.architecture")
        k = f"{arch}."
        n_embd = int(f.require(k + "embedding_length"))
        n_head = int(f.require(k + "attention.head_count"))
        n_vocab = f.get(k + "vocab_size") or f.get("tokenizer.ggml.tokens") or 0
        if not n_vocab and "token_embd.weight" in f.tensors:
            n_vocab = f.tensors["token_embd.weight"].ne[1]
        hp = cls(
            arch=arch,
            n_layer=int(f.require(k + "block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(f.get(k + "attention.head_count_kv", n_head)),
            head_dim=int(f.get(k + "attention.key_length", n_embd // n_head)),
            n_vocab=int(n_vocab),
            n_ff=int(f.get(k + "feed_forward_length", 0)),
            n_expert=int(f.get(k + "expert_count", 0)),
            n_expert_used=int(f.get(k + "expert_used_count", 0)),
            n_ff_exp=int(f.get(k + "expert_feed_forward_length", 0)),
            rope_base=float(f.get(k + "rope.freq_base", 10000.0)),
            rms_eps=float(f.require(k + "attention.layer_norm_rms_epsilon")),
            n_ctx_train=int(f.get(k + "context_length", 4096)),
        )
        value_len = int(f.get(k + "attention.value_length", hp.head_dim))
        if value_len != hp.head_dim or hp.n_head % hp.n_head_kv:
            raise WeightsError(f"{f.path}: unsupported head layout (value_length {value_len}, "
                               f"heads {hp.n_head}/{hp.n_head_kv})")
        if hp.is_moe and not 0 < hp.n_expert_used <= hp.n_expert:
            raise WeightsError(f"{f.path}: expert_used_count {hp.n_expert_used} is not in "
                               f"1..{hp.n_expert}")
        return hp

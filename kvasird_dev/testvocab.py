"""Vocabulary-only GGUFs for tokenizer checks: the bundled vocabulary under each
pre-tokenizer name the models we serve declare, and a SentencePiece vocabulary derived from
it (gemma's kind). llama.cpp loads them with ``vocab_only``, so our tokenization can be
compared with its own on the same file; no tensors, a few MB each.

The SentencePiece one is built as such vocabularies are: byte tokens ``<0x00>``..``<0xFF>``,
control tokens, then every piece the BPE knows with spaces written "▁", scored by merge
order (earlier merges score higher), so that every merged piece has its two halves in the
vocabulary, as a trained SentencePiece BPE has.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from kvasird_dev.testmodels import bundled_tokenizer, save

BPE_PRES = ("qwen2", "qwen35", "gpt-4o", "llama-bpe", "smollm")
"""Pre-tokenizer names of the byte-level BPE models we serve (qwen3/qwen3moe, Qwen3.5,
gpt-oss, llama 3, the bundled SmolLM2)."""
CONTROL, USER_DEFINED, BYTE = 3, 4, 6
SPM_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")


def write_vocab(path: Path, kind: str = "gpt2", pre: str = "qwen2",
                add_space_prefix: bool = False) -> Path:
    """A vocabulary-only GGUF: the bundled BPE with ``pre`` ("gpt2" kind), or the
    SentencePiece vocabulary derived from it ("llama" kind)."""
    keys = bundled_tokenizer()
    writer = GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 512), ("embedding_length", 64), ("block_count", 1),
                       ("feed_forward_length", 128), ("attention.head_count", 4)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    if kind == "gpt2":
        for key, (vtype, sub, value) in keys.items():
            if key == "tokenizer.ggml.pre":
                value = pre
            writer.add_key_value(key, value, GGUFValueType(vtype),
                                 GGUFValueType(sub) if sub else None)
    elif kind == "llama":
        tokens, scores, types = _sentencepiece(keys)
        writer.add_string("tokenizer.ggml.model", "llama")
        writer.add_array("tokenizer.ggml.tokens", tokens)
        writer.add_array("tokenizer.ggml.scores", scores)
        writer.add_array("tokenizer.ggml.token_type", types)
        writer.add_uint32("tokenizer.ggml.bos_token_id", SPM_SPECIALS.index("<bos>"))
        writer.add_uint32("tokenizer.ggml.eos_token_id", SPM_SPECIALS.index("<eos>"))
        writer.add_uint32("tokenizer.ggml.unknown_token_id", SPM_SPECIALS.index("<unk>"))
        writer.add_uint32("tokenizer.ggml.padding_token_id", SPM_SPECIALS.index("<pad>"))
        writer.add_bool("tokenizer.ggml.add_bos_token", False)
        writer.add_bool("tokenizer.ggml.add_space_prefix", add_space_prefix)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}: use gpt2 or llama")
    return save(writer, path)


def _sentencepiece(keys: dict) -> tuple[list[str], list[float], list[int]]:
    from kvasird.text.tokenizer import _unicode_to_byte
    byte_of = _unicode_to_byte()
    bpe_tokens = keys["tokenizer.ggml.tokens"][2]
    bpe_types = keys["tokenizer.ggml.token_type"][2]
    tokens = list(SPM_SPECIALS)
    types = [CONTROL] * len(SPM_SPECIALS)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    seen = set(tokens)
    for token, kind in zip(bpe_tokens, bpe_types, strict=True):
        if kind != 1:
            continue
        try:
            text = bytes(byte_of[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue  # part of a character: SentencePiece has bytes for those
        piece = text.replace(" ", "\u2581")
        if piece and piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
    n_fixed = len(SPM_SPECIALS) + 256
    scores = [0.0] * n_fixed + list(-np.arange(len(tokens) - n_fixed, dtype=np.float64))
    return tokens, [float(s) for s in scores], types

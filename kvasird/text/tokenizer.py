"""The model's tokenizer, built from the GGUF's own vocabulary (no hub, no extra files).

A GGUF carries everything its tokenizer needs under ``tokenizer.ggml.*``. Most are
byte-level BPE (``tokenizer.ggml.model = "gpt2"``): the token
strings (in GPT-2's byte-to-unicode alphabet), the merge list, token types (control,
user-defined...), the special token ids, and the name of the pre-tokenizer (the regex
that splits text into words before merging). We hand vocabulary, merges and the
pre-tokenizer llama.cpp uses for that name to HF ``tokenizers`` (maintained, Rust, fast)
and keep decoding to ourselves: a token is a run of *bytes*, and a character may be
split across tokens, so text is released only once its bytes form whole UTF-8
characters (``StreamDecoder``). SentencePiece vocabularies (``"llama"``: gemma, Llama 2,
Mistral) are encoded by ``kvasird.text.spm`` as llama.cpp encodes them.

Special tokens (control and user-defined types) are recognised in text only when the
caller asks (``special=True``, llama.cpp's ``parse_special``): the gateway asks for the
rendered chat template, whose role markers must become control tokens, and for raw
/v1/completions prompts unless ``[gateway] parse_special`` is off (llama-server parses
them too); everything else, a chat message's own text included, is encoded as plain text.
"""

from __future__ import annotations

import codecs
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from kvasird.errors import ModelError
from kvasird.model.gguffile import GGUFFormatError, read_header
from kvasird.text.spm import SentencePiece

CONTROL, USER_DEFINED = 3, 4
"""llama.cpp token types that are special (matched whole, never merged into)."""

END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_text|>",
        "<EOT>",
        "<|return|>",
        "<|call|>",
    }
)
"""Control tokens that end a turn even when the GGUF names only one EOS (as llama.cpp does)."""

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
    r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEXES = {
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "qwen2": _QWEN2,
    "qwen35": _QWEN35,
    "gpt-4o": _GPT4O,
}
"""Pre-tokenizer names (llama.cpp's) -> the split regex of the model's tokenizer.json."""
_STARCODER_FAMILY = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


class TokenizerError(ModelError):
    """The GGUF's tokenizer is missing or of a kind kvasird does not implement."""


def pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for ``tokenizer.ggml.pre`` = ``name``, as HF pieces."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("default", "gpt2", "gpt-2"):
        return byte_level
    if name in _STARCODER_FAMILY:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regex = _REGEXES.get(name)
    if regex is None:
        raise TokenizerError(
            f"pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; "
            "supported: gpt2, " + ", ".join([*_REGEXES, *_STARCODER_FAMILY])
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character table, read backwards."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


@dataclass(frozen=True)
class SpecialTokens:
    """Ids the generation and the chat template need."""

    bos: int | None
    """Beginning of sequence (``tokenizer.ggml.bos_token_id``)."""
    eos: int | None
    """End of sequence (``tokenizer.ggml.eos_token_id``)."""
    eot: int | None
    """End of turn, when the model has a separate one (``tokenizer.ggml.eot_token_id``)."""
    add_bos: bool
    """Whether a prompt starts with BOS (``tokenizer.ggml.add_bos_token``)."""
    end_of_generation: frozenset[int]
    """Every id that ends a reply: EOS, EOT, EOM and control tokens named like an end marker."""


class Tokenizer:
    """Text <-> token ids for one model; also the chat template's source text."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        pre: str,
        special: SpecialTokens,
        chat_template: str | None = None,
        *,
        sentencepiece: tuple[Sequence[float], bool] | None = None,
    ) -> None:
        """A byte-level BPE of ``merges`` split by the pre-tokenizer ``pre``; or, given
        ``sentencepiece`` = (scores, add_space_prefix), a SentencePiece vocabulary."""
        self.tokens = list(tokens)
        self.special = special
        self.chat_template = chat_template
        self._special_ids = frozenset(
            i for i, k in enumerate(token_types) if k in (CONTROL, USER_DEFINED)
        )
        self._control_ids = frozenset(i for i, k in enumerate(token_types) if k == CONTROL)
        """What decoding leaves out unless asked: user-defined tokens (Qwen's <tool_call>,
        <think>) are text the model writes, and llama.cpp renders them always."""
        self._hf: HFTokenizer | None = None
        self._spm: SentencePiece | None = None
        if sentencepiece is not None:
            scores, prefix = sentencepiece
            self._spm = SentencePiece(
                self.tokens,
                scores,
                token_types,
                sorted(self._special_ids),
                [i for i, k in enumerate(token_types) if k == USER_DEFINED],
                prefix,
            )
            self._bytes = [
                t.encode() if i in self._special_ids else self._spm.token_bytes[i]
                for i, t in enumerate(self.tokens)
            ]
            return
        vocab = {t: i for i, t in enumerate(self.tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        hf = HFTokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=False))  # type: ignore[arg-type]
        hf.pre_tokenizer = pre_tokenizer(pre)
        hf.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, kind in zip(self.tokens, token_types, strict=True)
                if kind in (CONTROL, USER_DEFINED)
            ]
        )
        self._hf = hf
        byte_of = _unicode_to_byte()
        self._bytes = [
            t.encode() if i in self._special_ids else bytes(byte_of.get(c, 0x3F) for c in t)
            for i, t in enumerate(self.tokens)
        ]

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return _from_gguf(Path(path))

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, int, object]], source: str) -> Tokenizer:
        """The tokenizer in a GGUF's metadata (as a manifest carries it: a node that holds
        any part of a model can tokenize for it); ``source`` names it in errors."""
        return _from_meta(
            {key: value for key, _, value in metadata if key.startswith("tokenizer.")}, source
        )

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text``; with ``special`` its control-token markers become those tokens.

        BOS is never added here: the chat template (or the caller) decides.
        """
        if self._spm is not None:
            return self._spm.encode(text, special=special)
        assert self._hf is not None
        self._hf.encode_special_tokens = not special
        return list(self._hf.encode(text, add_special_tokens=False).ids)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a special token: its marker text)."""
        return self._bytes[token] if 0 <= token < len(self._bytes) else b""

    def decode(self, tokens: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of the tokens; bytes that are not valid UTF-8 become U+FFFD."""
        return b"".join(
            self.token_bytes(t) for t in tokens if not (skip_special and t in self._control_ids)
        ).decode("utf-8", "replace")

    def is_special(self, token: int) -> bool:
        """Matched whole, never merged into (control and user-defined tokens)."""
        return token in self._special_ids

    def is_control(self, token: int) -> bool:
        """A control token (<|im_start|>, <|channel|>...): left out of decoded text unless asked."""
        return token in self._control_ids

    def stream(self, *, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Decodes one generation token by token, never emitting half a character.

    A multi-byte character split across tokens is held back until its last byte
    arrives; ``finish`` flushes whatever is left (an incomplete tail becomes U+FFFD).
    Control tokens the model emits (a stray ``<|im_start|>``) are dropped unless asked for;
    user-defined ones (``<tool_call>``) are text.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        if self._skip and self._tok.is_control(token):
            return ""
        return str(self._utf8.decode(self._tok.token_bytes(token)))

    def finish(self) -> str:
        return str(self._utf8.decode(b"", final=True))


@lru_cache(maxsize=4)
def _from_gguf(path: Path) -> Tokenizer:
    try:
        meta = {
            key: value
            for key, _, value in read_header(path).metadata
            if key.startswith("tokenizer.")
        }
    except (GGUFFormatError, OSError) as exc:
        raise TokenizerError(f"cannot read the tokenizer of {path}: {exc}") from None
    return _from_meta(meta, str(path))


def _from_meta(meta: dict[str, object], source: str) -> Tokenizer:
    kind = _text(meta.get("tokenizer.ggml.model", b""))
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(
            f"{source}: tokenizer model {kind!r} is not supported (supported: "
            'byte-level BPE "gpt2", SentencePiece "llama")'
        )
    tokens = [_text(t) for t in _strings(meta, "tokenizer.ggml.tokens", source)]
    types = _numbers(meta, "tokenizer.ggml.token_type", "i", len(tokens)) or [1] * len(tokens)
    merges: list[str] = []
    sentencepiece = None
    if kind == "llama":
        scores = _numbers(meta, "tokenizer.ggml.scores", "f", len(tokens))
        if scores is None:
            raise TokenizerError(
                f"{source} lacks tokenizer.ggml.scores: a SentencePiece "
                "vocabulary needs its token scores"
            )
        sentencepiece = scores, bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    else:
        merges = [_text(m) for m in _strings(meta, "tokenizer.ggml.merges", source)]

    def token_id(name: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

    ends = {i for i in (token_id("eos"), token_id("eot"), token_id("eom")) if i is not None}
    ends |= {
        i for i, t in enumerate(tokens) if types[i] == CONTROL and t in END_OF_GENERATION_TEXTS
    }
    if {"<|return|>", "<|call|>"} <= set(tokens) and "<|end|>" in tokens:
        # harmony (gpt-oss): <|end|> closes a message (the reasoning before the answer or a
        # call), <|return|> and <|call|> the reply; llama.cpp drops it from its EOG set too
        ends.discard(tokens.index("<|end|>"))
    special = SpecialTokens(
        bos=token_id("bos"),
        eos=token_id("eos"),
        eot=token_id("eot"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        end_of_generation=frozenset(ends),
    )
    template = meta.get("tokenizer.chat_template")
    return Tokenizer(
        tokens,
        types,
        merges,
        _text(meta.get("tokenizer.ggml.pre", b"default")),
        special,
        _text(template) if template else None,
        sentencepiece=sentencepiece,
    )


def _strings(meta: dict[str, object], key: str, source: str) -> list[bytes]:
    value = meta.get(key)
    if not (isinstance(value, tuple) and isinstance(value[1], list)):
        raise TokenizerError(f"{source} lacks {key}: the GGUF has no usable tokenizer")
    return value[1]


def _numbers(meta: dict[str, object], key: str, code: str, n: int) -> list | None:
    """A numeric array of ``n`` items ("i" int32, "f" float32), or None if absent."""
    value = meta.get(key)
    if isinstance(value, tuple) and isinstance(value[1], bytes) and len(value[1]) == 4 * n:
        return list(struct.unpack(f"<{n}{code}", value[1]))
    if isinstance(value, tuple) and isinstance(value[1], list) and len(value[1]) == n:
        return list(value[1])
    return None


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

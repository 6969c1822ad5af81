"""What a person calls a model: a name from its GGUF ("SmolLM2 135M Instruct") and the
slug a request or a command line can carry ("smollm2-135m-instruct").

The model id (the manifest's sha256) stays what identifies a model; a name is for reading
and typing. It is built from the GGUF's ``general.*`` keys, which every slice of the model
carries. The file name takes precedence when it follows GGUF's naming convention
(``<BaseName>-<SizeLabel>-<FineTune>-<Version>-<Encoding>.gguf``) and agrees with the
metadata's basename and size label: converters lower-case the basename and write the
training run into ``general.finetune`` ("smollm2", "8k-lc100k-mix1-ep2"), where the
publisher's file name keeps what people know the model as ("SmolLM2-135M-Instruct").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_ENCODING = re.compile(r"(?:I?Q\d+(?:_[A-Z0-9]+)*|TQ\d_\d|B?F\d+|MXFP4)", re.IGNORECASE)
"""The quantization a file name may end with: Q4_1, Q4_K_M, IQ2_XS, F16, BF16, ..."""
_SHARD = re.compile(r"-\d{5}-of-\d{5}$")
_SLUG_GAP = re.compile(r"[^a-z0-9.]+")


def human_name(metadata: Mapping[str, Any], file_name: str = "") -> str:
    """The model's name as a person reads it, from its GGUF metadata and file name."""
    basename, size = _text(metadata, "general.basename"), _text(metadata, "general.size_label")
    words = _file_words(file_name)
    if basename and words and _agrees(words, basename, size):
        return " ".join(words)
    if basename:
        return " ".join(w for w in (basename, size, _text(metadata, "general.finetune"),
                                    _text(metadata, "general.version")) if w)
    return _text(metadata, "general.name") or " ".join(words) or "unnamed model"


def slug(name: str) -> str:
    """The name in lower case, words joined by "-": a model name without quoting."""
    return _SLUG_GAP.sub("-", name.lower()).strip("-.")


def _text(metadata: Mapping[str, Any], key: str) -> str:
    value = metadata.get(key)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return " ".join(value.split()) if isinstance(value, str) else ""


def _file_words(file_name: str) -> list[str]:
    """The words of a GGUF file name without its extension, shard and encoding."""
    stem = _SHARD.sub("", file_name.removesuffix(".gguf"))
    head, dot, last = stem.rpartition(".")
    if dot and _ENCODING.fullmatch(last):
        stem = head
    words = [w for w in re.split(r"[-\s]+", stem) if w]
    while len(words) > 1 and (_ENCODING.fullmatch(words[-1])
                              or words[-1].lower() in ("lora", "vocab")):
        words.pop()
    return words


def _agrees(words: list[str], basename: str, size: str) -> bool:
    """Whether the file name names the model its metadata describes."""
    named, base = slug(" ".join(words)), slug(basename)
    if named != base and not named.startswith(base + "-"):
        return False
    return not size or f"-{slug(size)}-" in f"-{named}-"

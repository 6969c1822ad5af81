"""What a person calls a model: its name on the network, ``family:size[-variant]`` as
ollama names models ("smollm2:135m-instruct"), the human name it comes from ("SmolLM2 135M
Instruct") and the slug a request may still carry ("smollm2-135m-instruct").

The model id (the manifest's sha256) stays what identifies a model; a name is for reading
and typing. The manifest carries no file name, so a model's name travels in its holders'
signed coverage records: the holders that imported the file (or named it with `kvasird
model add --name`) choose it, every other node adopts the one most of them announce
(``agreed_name``), so one model has one name on every node.

A name is built from the GGUF's ``general.*`` keys, which every slice of the model
carries. The file name takes precedence when it follows GGUF's naming convention
(``<BaseName>-<SizeLabel>-<FineTune>-<Version>-<Encoding>.gguf``) and agrees with the
metadata's basename and size label: converters lower-case the basename and write the
training run into ``general.finetune`` ("smollm2", "8k-lc100k-mix1-ep2"), where the
publisher's file name keeps what people know the model as ("SmolLM2-135M-Instruct").
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from kvasird.errors import ModelError

_ENCODING = re.compile(r"(?:I?Q\d+(?:_[A-Z0-9]+)*|TQ\d_\d|B?F\d+|MXFP4)", re.IGNORECASE)
"""The quantization a file name may end with: Q4_1, Q4_K_M, IQ2_XS, F16, BF16, ..."""
_SHARD = re.compile(r"-\d{5}-of-\d{5}$")
_SLUG_GAP = re.compile(r"[^a-z0-9.]+")
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}(?::[a-z0-9][a-z0-9._-]{0,63})?")
"""A model name: a family, then optionally ":" and a tag (size and variant)."""
MIN_PREFIX = 8
"""Hex digits an id prefix needs to name a model (fewer would match too much by chance)."""
_HEX = re.compile(r"[0-9a-f]+")
NAME_FORM = (
    "a model name is lower-case letters, digits, '.', '-' and '_', a family and "
    "optionally ':' and a tag, 64 characters each (e.g. smollm2:135m-instruct)"
)


def model_name(metadata: Mapping[str, Any], file_name: str = "") -> str:
    """The model's name on the network: its basename as the family, what its human name
    says after the basename (size, variant) as the tag."""
    words = slug(human_name(metadata, file_name))
    family = slug(_text(metadata, "general.basename"))
    if not family or not words.startswith(family):
        return _part(words) or "model"
    tag = _part(words[len(family) :])
    return f"{_part(family)}:{tag}" if tag else _part(family)


def checked_name(text: str, where: str = "") -> str:
    """``text`` as a model name (in lower case), or a ModelError saying what one looks like;
    ``where`` (e.g. "--name") opens the message."""
    name = text.strip().lower()
    if not NAME.fullmatch(name):
        said = f"{where} {text!r}" if where else repr(text)
        raise ModelError(f"{said} is not a model name: {NAME_FORM}")
    return name


def named_by(text: str, model_id: str, name: str) -> bool:
    """Whether ``text`` (a request's model, a command's argument) names the model
    ``model_id`` called ``name``: the id, a prefix of it of MIN_PREFIX+ hex digits, the
    name, or its slug (the form names had before they were ``family:tag``, which a human
    name such as "SmolLM2 135M Instruct" slugs to as well)."""
    folded = text.strip().lower()
    if not folded:
        return False
    if folded in (model_id, name) or (
        len(folded) >= MIN_PREFIX and _HEX.fullmatch(folded) and model_id.startswith(folded)
    ):
        return True
    return bool(name) and slug(folded) == slug(name)


def agreed_name(claims: Iterable[tuple[str, bool]]) -> str:
    """The name the network gives a model, from its holders' claims (name, whether the
    holder chose it): the one most holders that chose a name announce, else the one most
    announce (a network whose choosers left); ties go to the name first in sort order,
    so every node that sees the same claims agrees. "" when no one names it."""
    named = [(name, chosen) for name, chosen in claims if name]
    chosen = [name for name, by_choice in named if by_choice]
    counts = Counter(chosen or [name for name, _ in named])
    return min(counts, key=lambda name: (-counts[name], name), default="")


def human_name(metadata: Mapping[str, Any], file_name: str = "") -> str:
    """The model's name as a person reads it, from its GGUF metadata and file name."""
    basename, size = _text(metadata, "general.basename"), _text(metadata, "general.size_label")
    words = _file_words(file_name)
    if basename and words and _agrees(words, basename, size):
        return " ".join(words)
    if basename:
        return " ".join(
            w
            for w in (
                basename,
                size,
                _text(metadata, "general.finetune"),
                _text(metadata, "general.version"),
            )
            if w
        )
    return _text(metadata, "general.name") or " ".join(words) or "unnamed model"


def slug(name: str) -> str:
    """The name in lower case, words joined by "-": a model name without quoting."""
    return _SLUG_GAP.sub("-", name.lower()).strip("-.")


def _part(text: str) -> str:
    """A family or tag of a name: slug characters, 64 at most, no "-" or "." at either end."""
    return text[:64].strip("-.")


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
    while len(words) > 1 and (
        _ENCODING.fullmatch(words[-1]) or words[-1].lower() in ("lora", "vocab")
    ):
        words.pop()
    return words


def _agrees(words: list[str], basename: str, size: str) -> bool:
    """Whether the file name names the model its metadata describes."""
    named, base = slug(" ".join(words)), slug(basename)
    if named != base and not named.startswith(base + "-"):
        return False
    return not size or f"-{slug(size)}-" in f"-{named}-"

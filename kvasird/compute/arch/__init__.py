"""Architectures: one module each, composing the shared blocks into a layer.

An architecture says which tensors a layer holds and how its graph is built. MoE
architectures split a layer in two at the router (`dense`), so that the stage can send
the routed rows to experts held elsewhere and add the combined result itself; `layer`
is the whole layer with every expert held locally. Adding an architecture is adding
a module here and its name to `_MODULES`: llama, llama_moe (llama with experts, as
Mixtral), qwen3, qwen3moe, gemma3, gpt_oss, qwen35 and qwen35moe.

llama.cpp's name alone does not always say which: "llama" is dense Llama and, with
`llama.expert_count` > 0, Mixtral's routed experts. So an architecture is looked up by
its name and whether the file has experts (`get(name, n_expert)`, `for_hparams(hp)`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvasird.compute.blocks import Blocks, RouterOut
from kvasird.compute.errors import WeightsError
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.graph import Tensor
from kvasird.compute.hparams import HParams
from kvasird.compute.shapes import check_model

_MODULES = ("llama", "llama_moe", "qwen3", "qwen3moe", "gemma3", "qwen35", "qwen35moe", "gpt_oss")


@dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture's layer is laid out and computed."""

    name: str
    """llama.cpp's `general.architecture` value."""
    dense_tensors: tuple[str, ...]
    """Per-layer tensor suffixes of the dense path (after "blk.N."), in every layer (a
    hybrid's layers add those of their kind)."""
    expert_tensors: tuple[str, ...]
    """Per-layer suffixes of the 3-D expert tensors (empty for dense models)."""
    layer: Callable[[Blocks, int, Tensor], Tensor]
    """Whole layer: hidden [n_embd, T] in, hidden out (experts, if any, held locally)."""
    dense: Callable[[Blocks, int, Tensor], RouterOut] | None = None
    """MoE only: attention and router, stopping where the expert FFN begins."""
    scaled_embedding: bool = False
    """The embedding rows are multiplied by sqrt(n_embd) (gemma)."""
    attention_tensors: tuple[str, ...] = ()
    """Hybrids: a full-attention layer's own dense-path suffixes."""
    recurrent_tensors: tuple[str, ...] = ()
    """Hybrids: a delta-net layer's own dense-path suffixes."""

    def layer_tensors(self, hp: HParams, layer: int) -> tuple[str, ...]:
        """The dense-path suffixes `layer` holds."""
        own = self.recurrent_tensors if hp.is_recurrent(layer) else self.attention_tensors
        return self.dense_tensors + own

    @property
    def is_moe(self) -> bool:
        return self.dense is not None

    @property
    def label(self) -> str:
        """How a person names it: llama.cpp's name, plus "with experts" where that name
        also covers a dense variant."""
        dense_too = any(a.name == self.name and not a.is_moe for a in _all())
        return f"{self.name} with experts" if self.is_moe and dense_too else self.name


def routed_layer(
    dense: Callable[[Blocks, int, Tensor], RouterOut],
) -> Callable[[Blocks, int, Tensor], Tensor]:
    """A MoE architecture's whole layer: its dense part, then every routed expert held
    locally, combined into the residual."""

    def layer(b: Blocks, layer: int, x: Tensor) -> Tensor:
        r = dense(b, layer, x)
        return b.combine(r, b.experts(layer, r.cur, r.ids))

    return layer


@functools.cache
def _all() -> tuple[Architecture, ...]:
    return tuple(importlib.import_module(f"kvasird.compute.arch.{m}").ARCH for m in _MODULES)


def supported() -> tuple[str, ...]:
    """Every supported architecture's label, for error messages and listings."""
    return tuple(a.label for a in _all())


def get(name: str, n_expert: int | None = None) -> Architecture:
    """The architecture for llama.cpp's `general.architecture` `name` with `n_expert`
    experts per layer (0: dense). Without a count, the name's only layout, or its dense
    one where it has both (as llama.cpp reads a file without `expert_count`)."""
    named = [a for a in _all() if a.name == name]
    if n_expert is None and named:
        return next((a for a in named if not a.is_moe), named[0])
    for a in named:
        if a.is_moe == bool(n_expert):
            return a
    what = repr(name)
    if named:
        what += f" with {n_expert} experts" if n_expert else " without experts"
    raise WeightsError(
        f"architecture {what} is not supported (supported: {', '.join(supported())})"
    )


def for_hparams(hp: HParams) -> Architecture:
    return get(hp.arch, hp.n_expert)


def check_file(path: str | Path) -> HParams:
    """What the engine needs of a GGUF before anything is loaded, imported or announced: an
    architecture it serves, in a layout it supports, with the tensors its metadata implies.
    WeightsError says what is supported, or which tensors do not fit."""
    f = GGUFFile(path)
    name = f.get("general.architecture")
    if not isinstance(name, str):
        raise WeightsError(f"{f.path} names no general.architecture: it is no model file")
    try:
        arch = get(name, int(f.get(f"{name}.expert_count", 0) or 0))
    except WeightsError as exc:
        raise WeightsError(f"{f.path}: {exc}") from None
    hp = HParams.from_gguf(f)
    check_model(f, hp, arch)
    return hp

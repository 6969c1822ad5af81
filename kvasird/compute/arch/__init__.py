"""Architectures: one module each, composing the shared blocks into a layer.

An architecture says which tensors a layer holds and how its graph is built. MoE
architectures split a layer in two at the router (`dense`), so that the stage can send
the routed rows to experts held elsewhere and add the combined result itself; `layer`
is the whole layer with every expert held locally. Adding an architecture is adding
a module here and its name to `_MODULES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from kvasird.compute.blocks import Blocks, RouterOut
from kvasird.compute.errors import WeightsError
from kvasird.compute.graph import Tensor

_MODULES = ("llama", "qwen3moe")


@dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture's layer is laid out and computed."""

    name: str
    """llama.cpp's `general.architecture` value."""
    dense_tensors: tuple[str, ...]
    """Per-layer tensor suffixes of the dense path (after "blk.N.")."""
    expert_tensors: tuple[str, ...]
    """Per-layer suffixes of the 3-D expert tensors (empty for dense models)."""
    layer: Callable[[Blocks, int, Tensor], Tensor]
    """Whole layer: hidden [n_embd, T] in, hidden out (experts, if any, held locally)."""
    dense: Callable[[Blocks, int, Tensor], RouterOut] | None = None
    """MoE only: attention and router, stopping where the expert FFN begins."""

    @property
    def is_moe(self) -> bool:
        return self.dense is not None


def get(name: str) -> Architecture:
    if name not in _MODULES:
        raise WeightsError(f"architecture {name!r} is not supported "
                           f"(supported: {', '.join(_MODULES)})")
    return importlib.import_module(f"kvasird.compute.arch.{name}").ARCH

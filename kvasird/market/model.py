"""A model as the market sees it: its units and what each costs to hold."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvasird.model.manifest import HEAD, Manifest, Unit


@dataclass(frozen=True)
class MarketModel:
    model_id: str
    """sha256 of the model's canonical manifest (hex)."""
    n_layer: int
    """Number of transformer blocks."""
    n_expert: int
    """Experts per MoE layer; 0 for a dense model."""
    layer_bytes: np.ndarray
    """Bytes of each layer's dense path (attention, norms, router, dense FFN), shape [n_layer]."""
    expert_bytes: np.ndarray
    """Bytes of each expert, shape [n_layer, n_expert]."""
    head_bytes: int
    """Bytes of the head (token embedding, output norm, output matrix)."""

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> MarketModel:
        n_layer, n_expert = manifest.n_layer, manifest.n_expert
        layer = np.zeros(n_layer, dtype=np.int64)
        experts = np.zeros((n_layer, n_expert), dtype=np.int64)
        head = 0
        for unit, size in manifest.unit_sizes.items():
            if unit.kind == "layer":
                layer[unit.layer] = size
            elif unit.kind == "expert":
                experts[unit.layer, unit.expert] = size
            else:
                head = size
        return cls(manifest.model_id, n_layer, n_expert, layer, experts, head)

    @classmethod
    def uniform(
        cls,
        model_id: str,
        n_layer: int,
        n_expert: int,
        layer_bytes: int,
        expert_bytes: int,
        head_bytes: int,
    ) -> MarketModel:
        """A synthetic model (the simulator's 122B MoE, tests)."""
        return cls(
            model_id,
            n_layer,
            n_expert,
            np.full(n_layer, layer_bytes, dtype=np.int64),
            np.full((n_layer, n_expert), expert_bytes, dtype=np.int64),
            head_bytes,
        )

    def size(self, unit: Unit) -> int:
        if unit.kind == "layer":
            return int(self.layer_bytes[unit.layer])
        if unit.kind == "expert":
            return int(self.expert_bytes[unit.layer, unit.expert])
        return self.head_bytes

    def units(self) -> list[Unit]:
        out = [HEAD] + [Unit("layer", i) for i in range(self.n_layer)]
        out += [Unit("expert", i, e) for i in range(self.n_layer) for e in range(self.n_expert)]
        return out

    def contains(self, unit: Unit) -> bool:
        if unit.kind == "head":
            return True
        if unit.kind == "layer":
            return 0 <= unit.layer < self.n_layer
        return 0 <= unit.layer < self.n_layer and 0 <= unit.expert < self.n_expert

    @property
    def total_bytes(self) -> int:
        return int(self.layer_bytes.sum() + self.expert_bytes.sum() + self.head_bytes)

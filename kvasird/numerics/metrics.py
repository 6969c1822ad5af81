"""How far two tensors (engine vs oracle, GPU vs CPU, node vs node) are apart.

The numbers of the numerics contract, each with a plain meaning: L∞ (worst element),
relative L∞ (that, over the reference's largest magnitude), relative L2, cosine, the
KL divergence of the softmaxed rows (for logits), and top-1 agreement per row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Delta:
    """Distance of `got` from a reference `want`."""

    linf: float
    """max |got - want|."""
    rel_linf: float
    """linf / max |want|: the per-op figure, comparable across scales."""
    rel_l2: float
    """||got - want|| / ||want||."""
    cosine: float
    """Cosine similarity of the flattened tensors."""
    kl: float
    """Mean over rows of KL(softmax(want) || softmax(got)), rows along the last axis."""
    top1: float
    """Fraction of rows (last axis) whose argmax agrees."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def compare(got: np.ndarray, want: np.ndarray) -> Delta:
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    if g.shape != w.shape:
        raise ValueError(f"shapes differ: {g.shape} vs {w.shape}")
    d = g - w
    scale = float(np.abs(w).max()) or 1.0
    norm = float(np.linalg.norm(w)) or 1.0
    denom = float(np.linalg.norm(g) * np.linalg.norm(w)) or 1.0
    g2, w2 = g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1])
    return Delta(
        linf=float(np.abs(d).max()),
        rel_linf=float(np.abs(d).max()) / scale,
        rel_l2=float(np.linalg.norm(d)) / norm,
        cosine=float(g.ravel() @ w.ravel()) / denom,
        kl=kl_rows(w2, g2),
        top1=float(np.mean(g2.argmax(-1) == w2.argmax(-1))),
    )


def kl_rows(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean KL(p_ref || p) over rows, where p = softmax(row)."""
    lp = _log_softmax(logits)
    lq = _log_softmax(ref_logits)
    return float(np.mean(np.sum(np.exp(lq) * (lq - lp), axis=-1)))


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two generations, None when they agree."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))

"""The expert protocol's messages ("/kvasir/experts/1"), each a frozen type with its wire form.

    ExpertRequest  {op: experts, layer, first, rows: [m, n_embd], ids: i32 [m, n], for?}
    Outputs        {out: [m, n, n_embd]}

``parse`` validates a decoded frame into an ExpertRequest (WireError naming the field);
what depends on the worker (its n_embd, the experts it holds) the handler checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvasird.errors import WireError
from kvasird.inference.protocol import MAX_EXPERTS, MAX_LAYERS, tensors
from kvasird.wire import schema

MAX_GATEWAYS = 64
"""Most gateways one request's rows may be computed for."""


@dataclass(frozen=True, slots=True, eq=False)
class ExpertRequest:
    """Rows of one layer for the experts a worker holds."""

    layer: int
    first: int
    """The start of the expert range the caller saw the worker advertise: ids count from it."""
    rows: np.ndarray
    """float32 [m, n_embd]."""
    ids: np.ndarray
    """[m, n] expert ids, counted from `first` (int32 on the wire)."""
    gateways: tuple[str, ...] | None = None
    """The gateways whose sessions the rows belong to (the wire's ``for``); None: the
    caller's own (a stage stepping for itself names none)."""
    dt: str = "f32"
    """How the rows travel: "f32" or "f16"."""

    def to_wire(self) -> dict[str, Any]:
        out = {"op": "experts", "layer": self.layer, "first": self.first,
               "rows": tensors.encode(self.rows, self.dt), "ids": tensors.encode(self.ids, "i32")}
        if self.gateways is not None:
            out["for"] = list(self.gateways)
        return out

    @staticmethod
    def from_wire(d: dict[str, Any]) -> ExpertRequest:
        value: Any = d.get("rows")
        rows = tensors.decode(value, "experts.rows", ("f32", "f16"), (None, None))
        return ExpertRequest(
            schema.integer(d, "layer", 0, MAX_LAYERS - 1, "experts"),
            schema.integer(d, "first", 0, MAX_EXPERTS, "experts"), rows,
            tensors.decode(d.get("ids"), "experts.ids", ("i32",), (len(rows), None)),
            schema.text_list(d, "for", MAX_GATEWAYS, 128, "experts") if "for" in d else None,
            value["dt"])


@dataclass(frozen=True, slots=True, eq=False)
class Outputs:
    """The answer: each row's output of each expert it selected."""

    out: np.ndarray
    """float32 [m, n, n_embd]."""
    dt: str
    """How the outputs travel: "f32" or "f16"."""

    def to_wire(self) -> dict[str, Any]:
        return {"out": tensors.encode(self.out, self.dt)}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> Outputs:
        value: Any = d.get("out")
        out = tensors.decode(value, "reply.out", ("f32", "f16"), (None, None, None))
        return Outputs(out, value["dt"])


def parse(msg: dict[str, Any]) -> ExpertRequest:
    """The request a decoded expert frame holds, validated (WireError naming the field)."""
    if msg.get("op") != "experts":
        raise WireError(f"experts.op: unknown op {msg.get('op')!r:.40}")
    return ExpertRequest.from_wire(msg)

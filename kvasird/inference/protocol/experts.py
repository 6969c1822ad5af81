"""The expert protocol's messages ("/kvasir/experts/1"), each a frozen type with its wire form.

    ExpertRequest  {op: experts, layer, first, rows: [m, n_embd], ids: i32 [m, n],
                    for: [[delegation, rows], ...]}
    Outputs        {out: [m, n, n_embd]}

``for`` says whose sessions the rows belong to: the rows come grouped by gateway, and
each group is announced by that gateway's delegation to the caller (protocol.delegation)
and its number of rows, in the order of the rows. The worker checks the delegations and
has each gateway admitted for the units of its own rows (``selections``) before it
computes anything.

``parse`` validates a decoded frame into an ExpertRequest (WireError naming the field),
viewing the rows without copying them (tensors.view): the handler widens them once the
delegations passed. What depends on the worker (its n_embd, the experts it holds) the
handler checks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvasird.errors import WireError
from kvasird.inference.protocol import MAX_EXPERTS, MAX_LAYERS, delegation, tensors
from kvasird.wire import schema

MAX_GATEWAYS = 64
"""Most gateways one request's rows may be computed for."""
ADMITTED_S = 60.0
"""A caller that had a request admitted by a worker this recently may send it frames of
any size (rpc.Intake); before, only small ones."""


@dataclass(frozen=True, slots=True, eq=False)
class ExpertRequest:
    """Rows of one layer for the experts a worker holds."""

    layer: int
    first: int
    """The start of the expert range the caller saw the worker advertise: ids count from it."""
    rows: np.ndarray
    """[m, n_embd]: float32 to send; as received, the rows as they travelled (a view of the
    frame, f16 included) until ``widened``."""
    ids: np.ndarray
    """[m, n] expert ids, counted from `first` (int32 on the wire)."""
    groups: tuple[tuple[bytes, int], ...] = ()
    """(delegation, rows) per gateway, in the order of the rows (the wire's ``for``);
    empty when the caller named none, which no worker computes for."""
    dt: str = "f32"
    """How the rows travel: "f32" or "f16"."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "op": "experts",
            "layer": self.layer,
            "first": self.first,
            "rows": tensors.encode(self.rows, self.dt),
            "ids": tensors.encode(self.ids, "i32"),
            "for": [list(g) for g in self.groups],
        }

    def widened(self) -> ExpertRequest:
        """The request with its rows as float32 (tensors.widen: a copy, checked finite)."""
        return replace(self, rows=tensors.widen(self.rows, "experts.rows"))

    @staticmethod
    def from_wire(d: dict[str, Any]) -> ExpertRequest:
        value: Any = d.get("rows")
        rows = tensors.view(value, "experts.rows", ("f32", "f16"), (None, None))
        return ExpertRequest(
            schema.integer(d, "layer", 0, MAX_LAYERS - 1, "experts"),
            schema.integer(d, "first", 0, MAX_EXPERTS, "experts"),
            rows,
            tensors.decode(d.get("ids"), "experts.ids", ("i32",), (len(rows), None)),
            _groups(d, len(rows)) if "for" in d else (),
            value["dt"],
        )


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


def selections(ids: np.ndarray) -> int:
    """The units of expert work rows ask for: the experts they actually selected (rows are
    padded with repeats of their first id, as compute.experts packs them, and a row never
    selects an expert twice). The stage counts its sessions' work and the worker meters
    each gateway's rows by this one count."""
    if len(ids) == 1:
        return len(set(ids[0].tolist()))
    ordered = np.sort(ids, axis=1)
    return int(len(ordered) + np.count_nonzero(np.diff(ordered, axis=1)))


def _groups(d: dict[str, Any], rows: int) -> tuple[tuple[bytes, int], ...]:
    """The wire's ``for``: [delegation, rows] per gateway, the rows adding up to all of them
    (none at all: the handler refuses it, saying so)."""
    groups = schema.items(d, "for", MAX_GATEWAYS, "experts")
    if groups and (
        not all(
            type(g) is list
            and len(g) == 2
            and type(g[0]) is bytes
            and len(g[0]) <= delegation.MAX_BYTES
            and type(g[1]) is int
            and g[1] >= 1
            for g in groups
        )
        or sum(g[1] for g in groups) != rows
    ):
        raise WireError(
            f"experts.for: expected [delegation, rows] per gateway, the rows "
            f"adding up to the request's {rows}"
        )
    return tuple((g[0], g[1]) for g in groups)


def parse(msg: dict[str, Any]) -> ExpertRequest:
    """The request a decoded expert frame holds, validated (WireError naming the field)."""
    if msg.get("op") != "experts":
        raise WireError(f"experts.op: unknown op {msg.get('op')!r:.40}")
    return ExpertRequest.from_wire(msg)

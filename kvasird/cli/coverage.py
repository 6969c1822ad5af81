"""``kvasird coverage``: the coverage map this node sees, per layer and expert range."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvasird.admin import client
from kvasird.cli import home_of
from kvasird.model.names import named_by


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coverage", help="who holds which units of the model, and what is scarce")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--model",
        default=None,
        help="model name, id or id prefix (default: the model this node serves)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    view = client.get(home_of(args), "/v0/coverage")
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    model = view["model"]
    if model is None:
        print("this node serves no model (set [market] model); nothing to show")
        return 0
    if args.model and not named_by(args.model, model["id"], model.get("name", "")):
        print(
            f"this node serves {model.get('name') or model['id']} (id {model['id'][:16]}…), "
            f"not {args.model!r}; nothing to show"
        )
        return 0
    print(
        f"model {model.get('name', '')} (id {model['id'][:16]}…)  {model['n_layer']} layers × "
        f"{model['n_expert']} experts, "
        f"{model['bytes'] / 2**20:.1f} MiB; {len(view['holders'])} holders"
    )
    print(covered(view))
    print(f"{'unit':24} {'replicas':>8} {'target':>6} {'scarcity':>8}")
    for seg in view["segments"]:
        if seg["unit"] == "head":
            name = "head"
        elif seg["unit"] == "layers":
            a, b = seg["layers"]
            name = f"layers {a}-{b - 1}" if b - a > 1 else f"layer {a}"
        else:
            a, b = seg["experts"]
            name = f"layer {seg['layer']} experts {a}-{b - 1}"
        print(f"{name:24} {seg['replicas']:>8} {seg['target']:>6} {seg['scarcity']:>8.2f}")
    print(
        f"\nthis node holds {len(view['held'])} units "
        f"({view['held_bytes'] / 2**20:.1f} of {view['budget_bytes'] / 2**20:.1f} MiB)"
    )
    return 0


def covered(view: dict[str, Any]) -> str:
    """Whether the model can be served (every unit held by an online node), apart from
    whether every unit has its target replicas: a lone node holding the whole model serves
    it, with no spare."""
    if not view["routable"]:
        return "served: no, some units have no online holder (see below): add nodes or budget"
    short = sum(seg["replicas"] < seg["target"] for seg in view["segments"])
    if not short:
        return "served: yes, every unit at its target replicas"
    return (
        f"served: yes; {short} of {len(view['segments'])} units below their target "
        "replicas (no spare if a holder leaves: add nodes for redundancy)"
    )

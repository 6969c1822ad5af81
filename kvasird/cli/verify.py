"""``kvasird verify``: measure this node's engine against the float64 oracle (PASS/FAIL)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvasird.config import load as load_config
from kvasird.config.schema import ComputeConfig
from kvasird.numerics.contract import Verdict, VerifyPlan, verify


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check the compute engine against the float64 oracle")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="GGUF file to measure (default: the bundled SmolLM2)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads (default: [compute] threads, else one per core)",
    )
    p.add_argument(
        "--prompts", type=int, default=VerifyPlan.prompts, help="prompts in the logits set"
    )
    p.add_argument(
        "--greedy-tokens",
        type=int,
        default=VerifyPlan.greedy_tokens,
        help="tokens generated per greedy prompt",
    )
    p.add_argument(
        "--device",
        default=None,
        help="ggml device to compute on, as `kvasird native info` lists them "
        "(default: [compute] device, else the CPU)",
    )
    p.add_argument(
        "--kv", choices=("f16", "f32"), default=VerifyPlan.kv_dtype, help="KV cache type"
    )
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.set_defaults(func=_verify)


def _verify(args: argparse.Namespace) -> int:
    from kvasird.compute.graph import use_device
    from kvasird.model.bundled import bundled_path

    compute = _configured(args)
    use_device(args.device if args.device is not None else compute.device)
    threads = args.threads if args.threads is not None else compute.threads
    plan = VerifyPlan(prompts=args.prompts, greedy_tokens=args.greedy_tokens, kv_dtype=args.kv)
    verdict = verify(args.model or bundled_path(), threads, plan)
    if args.json:
        print(json.dumps(verdict.to_dict(), indent=2, default=str))
    else:
        _print(verdict)
    return 0 if verdict.passed else 1


def _configured(args: argparse.Namespace) -> ComputeConfig:
    from kvasird.cli import home_of

    path = home_of(args, required=False).config
    if not path.exists():
        return ComputeConfig()  # verify needs no initialised home: one thread per core, the CPU
    return load_config(path).compute


def _print(v: Verdict) -> None:
    print(f"model      {v.model}")
    print(f"backend    {v.backend}")
    print(f"precision  {v.precision}")
    print()
    print(f"{'check':34} {'value':>12} {'bound':>12}  result")
    for c in v.checks:
        sign = "<=" if c.kind == "max" else ">="
        print(f"{c.name:34} {c.value:12.6g} {sign}{c.bound:10.6g}  {'ok' if c.ok else 'FAIL'}")
    print()
    worst = max(range(len(v.drift)), key=lambda i: v.drift[i].rel_l2) if v.drift else None
    if worst is not None:
        print(
            f"layer drift: rel-L2 after layer 0 {v.drift[0].rel_l2:.3g}, "
            f"last {v.drift[-1].rel_l2:.3g}, worst {v.drift[worst].rel_l2:.3g} (layer {worst})"
        )
    lg = v.logits
    print(
        f"logits: L∞ {lg.linf:.4g}  rel-L2 {lg.rel_l2:.4g}  cosine {lg.cosine:.6f}  "
        f"KL {lg.kl:.3g}  top-1 {lg.top1:.3f}"
    )
    print(
        "greedy first divergence: "
        + ", ".join("none" if d is None else str(d) for d in v.greedy_divergence)
    )
    print()
    print("PASS" if v.passed else "FAIL")

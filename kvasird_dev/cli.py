"""``python -m kvasird_dev``: write generated test and benchmark models from the command line.

Run from the repository root (``-m`` finds the package there). Like ``kvasird``, a
KvasirError ends the command with its message on one line and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvasird.errors import KvasirError
from kvasird_dev.benchmodels import SPECS, bench_model
from kvasird_dev.testmodels import ARCHS, DTYPES, TestModelSpec, write_model

PROG = "python -m kvasird_dev"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args))
    except KvasirError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="kvasird developer tools",
                                     allow_abbrev=False)
    cmds = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    mk = cmds.add_parser("make-model", help="write a small random-weight GGUF (llama.cpp loads it)")
    mk.add_argument("out", type=Path, help="output .gguf path")
    mk.add_argument("--arch", choices=ARCHS, default="qwen3moe",
                    help="mixtral: a llama file with routed experts")
    mk.add_argument("--dtype", choices=tuple(DTYPES), default="f32")
    mk.add_argument("--layers", type=int, default=2, help="transformer blocks")
    mk.add_argument("--embd", type=int, default=64, help="hidden size")
    mk.add_argument("--heads", type=int, default=4, help="attention heads")
    mk.add_argument("--heads-kv", type=int, default=2, help="key/value heads")
    mk.add_argument("--head-dim", type=int, default=16, help="per-head size")
    mk.add_argument("--ff", type=int, default=128, help="dense FFN size (llama, qwen3)")
    mk.add_argument("--experts", type=int, default=8, help="experts per layer (qwen3moe, mixtral)")
    mk.add_argument("--experts-used", type=int, default=2, help="top-k experts per token")
    mk.add_argument("--ff-exp", type=int, default=32, help="expert FFN size (qwen3moe, mixtral)")
    mk.add_argument("--sliding-window", type=int, default=4,
                    help="gemma3: positions a sliding-window layer sees")
    mk.add_argument("--swa-pattern", type=int, default=2,
                    help="gemma3: every N-th layer global, the others windowed (0: all windowed)")
    mk.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                    help="omit `output` and reuse token_embd (default: llama and gemma3 tied)")
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(func=_make_model)
    bm = cmds.add_parser("bench-models", help="write the real-width benchmark models "
                         "(Llama-3.2-1B and Qwen3-30B-A3B shapes, Q4_K_M), cached")
    bm.add_argument("names", nargs="*", metavar="NAME",
                    help=f"which ({', '.join(SPECS)}; default: all)")
    bm.add_argument("--cache", type=Path, default=Path(".cache"),
                    help="cache folder (default: the project's .cache)")
    bm.add_argument("--moe-layers", type=int, default=0,
                    help=f"layers of the moe model (default {SPECS['moe'].n_layer})")
    bm.set_defaults(func=_bench_models)
    return parser


def _make_model(args: argparse.Namespace) -> int:
    spec = TestModelSpec(
        arch=args.arch, n_layer=args.layers, n_embd=args.embd, n_head=args.heads,
        n_head_kv=args.heads_kv, head_dim=args.head_dim, n_ff=args.ff, n_expert=args.experts,
        n_expert_used=args.experts_used, n_ff_exp=args.ff_exp, dtype=args.dtype,
        sliding_window=args.sliding_window, swa_pattern=args.swa_pattern,
        tied_output=args.tied, seed=args.seed,
    )
    path = write_model(args.out, spec)
    print(f"{path}  {spec.arch} {spec.dtype} {spec.n_layer} layers, {path.stat().st_size} bytes")
    return 0


def _bench_models(args: argparse.Namespace) -> int:
    if unknown := [n for n in args.names if n not in SPECS]:
        print(f"{PROG} bench-models: unknown model {', '.join(unknown)}: use "
              f"{' or '.join(SPECS)}")
        return 2
    for name in args.names or list(SPECS):
        path = bench_model(args.cache, name, args.moe_layers if name == "moe" else 0)
        print(f"{name:6} {path}  {path.stat().st_size / 2**30:.2f} GiB")
    return 0

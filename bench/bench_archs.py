"""Every supported architecture against llama.cpp: logits and greedy tokens on the same ids.

    .venv/bin/python bench/bench_archs.py [--prompts 8] [--prompt-len 16] [--new 16]
                                          [--layers 3] [--dtypes f32,q8_0]

For each architecture the generator writes (kvasird_dev.testmodels.ARCHS) and each
weight type, a tiny random-weight model is generated (the bundled tokenizer, real
llama.cpp metadata), and llama.cpp (llama-cpp-python from .cache/llamacpp-venv, built by
native/llamacpp) and kvasird (one stage holding the whole model, F16 KV as llama.cpp's
default) run the same random prompts; gpt-oss also as its files ship, its experts in
MXFP4 and the rest Q8_0 (type "mxfp4"). One table: cosine, top-1 agreement and max |delta|
of the last-position logits over all prompts, and how many prompts' greedy continuations
are equal token for token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # kvasird_dev (not installed)
sys.path.insert(0, str(HERE.parent / "tests" / "compute"))

from bench_compute import LLAMACPP_PYTHON  # noqa: E402
from test_llamacpp import ours_and_llamacpp, random_prompts  # noqa: E402

from kvasird.compute import arch as archs  # noqa: E402
from kvasird.compute.ggufview import GGUFFile  # noqa: E402
from kvasird.compute.hparams import HParams  # noqa: E402
from kvasird.numerics.metrics import compare  # noqa: E402
from kvasird_dev.testmodels import ARCHS, make_model  # noqa: E402


def measure(path: Path, prompts: list[list[int]], n_new: int) -> dict[str, float | str]:
    got, want, ours, theirs = ours_and_llamacpp(path, prompts, n_new)
    m = compare(got, want)
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return {"cosine": m.cosine, "top1": m.top1, "delta": float(np.abs(got - want).max()),
            "greedy": f"{agree}/{len(prompts)}"}


AS_SHIPPED = {"gpt-oss": {"mxfp4": {"dtype": "q8_0", "expert_dtype": "mxfp4"}}}
"""Extra rows: an architecture's released files' mix of types, by the row's type label."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="random prompts per model")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    ap.add_argument("--new", type=int, default=16, help="greedy tokens compared per prompt")
    ap.add_argument("--layers", type=int, default=3, help="layers of each generated model")
    ap.add_argument("--dtypes", default="f32,q8_0", help="weight types, comma-separated")
    args = ap.parse_args()
    if not LLAMACPP_PYTHON.exists():
        print("llama.cpp is not built: run native/llamacpp (it builds .cache/llamacpp-venv)",
              file=sys.stderr)
        return 1
    prompts = random_prompts(args.prompts, args.prompt_len)
    print(f"llama.cpp vs kvasird: {args.prompts} random prompts of {args.prompt_len} tokens, "
          f"{args.new} greedy tokens each; generated {args.layers}-layer models, KV f16")
    print(f"{'architecture':20} {'type':6} {'cosine':>12} {'top-1':>6} {'max |delta|':>12} "
          f"{'greedy equal':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            rows = {t: {"dtype": t} for t in args.dtypes.split(",")} | AS_SHIPPED.get(arch, {})
            for dtype, types in rows.items():
                path = make_model(Path(tmp) / f"{arch}_{dtype}.gguf", arch=arch,
                                  n_layer=args.layers, **types)
                label = archs.for_hparams(HParams.from_gguf(GGUFFile(path))).label
                r = measure(path, prompts, args.new)
                print(f"{label:20} {dtype:6} {r['cosine']:12.9f} {r['top1']:6.2f} "
                      f"{r['delta']:12.3g} {r['greedy']:>13}", flush=True)
                path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())

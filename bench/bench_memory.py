"""Memory per session of every supported architecture, kvasird against llama.cpp on the
same file, at 4k and 32k tokens of context.

    .venv/bin/python bench/bench_memory.py [--layers 12] [--contexts 4096,32768]

For each architecture the generator writes (kvasird_dev.testmodels.ARCHS) a model of
``--layers`` layers (their real layer pattern: gemma3's sliding-window layers, the qwen35
family's delta-net layers) is generated; one session's cache is measured on both sides:
ours is what a stage holding the whole model allocates for a context of that many tokens,
one recurrent-state slot and one sliding-window ring (KV f16: the windowed layers keep
their window plus one chunk, kv/window.py); llama.cpp's is what it reports creating for one
sequence of that context (llama-cpp-python from .cache/llamacpp-venv, KV f16), with its
sliding-window cache full-size (llama-cpp-python's default) and bounded by the window
(window plus one batch): "ratio" is ours over the bounded one.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # kvasird_dev (not installed)

from bench_compute import LLAMACPP_PYTHON  # noqa: E402

from kvasird.compute.kv.pool import KVSpec  # noqa: E402
from kvasird.compute.stage import Stage  # noqa: E402
from kvasird_dev.testmodels import ARCHS, make_model  # noqa: E402

MIB = 2**20
LLAMACPP = r"""
import sys, llama_cpp
path, n_ctx, full = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=1, n_batch=512, swa_full=full,
                verbose=True)
"""
SIZE = re.compile(r"^(llama_kv_cache|llama_memory_recurrent): +size = +([\d.]+) MiB", re.M)


def ours(path: Path, n_ctx: int) -> float:
    stage = Stage.load(path, threads=1, kv=KVSpec(n_slots=n_ctx, dtype="f16", state_slots=1,
                                                   window_sessions=1))
    try:
        return stage.kv.arena.nbytes / MIB
    finally:
        stage.close()


def theirs(path: Path, n_ctx: int, swa_full: bool) -> float | None:
    if not LLAMACPP_PYTHON.exists():
        return None
    done = subprocess.run([str(LLAMACPP_PYTHON), "-c", LLAMACPP, str(path), str(n_ctx),
                           "1" if swa_full else "0"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp failed on {path}: {done.stderr[-1500:]}")
    return sum(float(m.group(2)) for m in SIZE.finditer(done.stderr))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="layers of each generated model")
    ap.add_argument("--contexts", default="4096,32768", help="context lengths, comma-separated")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if not LLAMACPP_PYTHON.exists():
        print("llama.cpp is not built (run native/llamacpp): only kvasird's column is filled")
    print(f"memory per session, MiB (KV f16; generated {args.layers}-layer models, n_embd 64, "
          "4 heads of 16, 2 KV heads)")
    print(f"{'arch':<12} {'context':>8} {'kvasird':>9} {'llama.cpp':>10} {'llama.cpp swa':>14}"
          f" {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            path = make_model(Path(tmp) / f"{arch}.gguf", arch=arch, n_layer=args.layers,
                              dtype="f32", context_length=max(contexts))
            for n_ctx in contexts:
                mine, full, bounded = ours(path, n_ctx), theirs(path, n_ctx, True), \
                    theirs(path, n_ctx, False)
                ratio = f"{mine / bounded:.2f}" if bounded else "-"
                print(f"{arch:<12} {n_ctx:>8} {mine:>9.2f} "
                      f"{'-' if full is None else f'{full:.2f}':>10} "
                      f"{'-' if bounded is None else f'{bounded:.2f}':>14} {ratio:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compute engine throughput: decode / prefill on the bundled model, expert worker vs batch size.

    .venv/bin/python bench/bench_compute.py [--threads N] [--decode 64] [--prefill 128]
                                            [--moe-embd 1024 --moe-ff 512 --moe-experts 32]

Prints one table. Rows:
  * decode and prefill tokens/s of one stage holding the whole bundled SmolLM2 (Q4_1),
    F16 KV cache, greedy, the given threads; side by side with llama.cpp on the same
    GGUF and threads when the optional environment built by native/llamacpp exists;
  * per-call Python overhead of a decode step (wall time minus ggml compute time);
  * an expert worker on a generated qwen3moe layer (Q8_0): per-call time and rows/s
    at batch 1, 8, 64, 512, and its Python overhead at batch 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvasird.compute.experts import ExpertWorker
from kvasird.compute.graph import Backend
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.runtime import compute_threads
from kvasird.compute.stage import Stage
from kvasird.compute.weights import load_weights
from kvasird.model.bundled import bundled_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvasird_dev (not installed)
from kvasird_dev.testmodels import make_model  # noqa: E402

LLAMACPP_PYTHON = Path(__file__).resolve().parent.parent / ".cache/llamacpp-venv/bin/python"

_LLAMACPP_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
path = sys.argv[1]
threads, n_prefill, n_decode = (int(a) for a in sys.argv[2:5])
llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False, logits_all=False)
prompt = [1 + (i * 7919) % 40000 for i in range(n_prefill)]
best = 1e9
for _ in range(3):
    llm.reset()
    t = time.perf_counter(); llm.eval(prompt); best = min(best, time.perf_counter() - t)
llm.reset(); llm.eval(prompt[:16])
t = time.perf_counter()
for _ in range(n_decode):
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    llm.eval([tok])
dt = time.perf_counter() - t
print(json.dumps({"prefill": n_prefill / best, "decode": n_decode / dt}))
"""


_LLAMACPP_DECODER = """
import json, os, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=1024, n_threads=int(sys.argv[2]),
            n_threads_batch=int(sys.argv[2]), n_batch=512, verbose=False, logits_all=False,
            n_gpu_layers=int(os.environ.get("KVASIR_LLAMACPP_GPU_LAYERS", "0")))
prompt = [int(t) for t in sys.argv[3].split(",")]
for line in sys.stdin:
    llm.reset(); llm.eval(prompt)
    n = int(line); t = time.perf_counter()
    for _ in range(n):
        llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
    print(json.dumps(n / (time.perf_counter() - t)), flush=True)
"""


class LlamaCppDecoder:
    """llama.cpp kept loaded in its own process: decode(n) greedy tokens/s on demand, so a
    benchmark can interleave its runs with ours and compare under the same machine load."""

    def __init__(self, threads: int, prompt: list[int], model: Path) -> None:
        self.proc = subprocess.Popen(
            [str(LLAMACPP_PYTHON), "-c", _LLAMACPP_DECODER, str(model), str(threads),
             ",".join(map(str, prompt))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)

    @classmethod
    def start(cls, threads: int, prompt: list[int], model: Path) -> LlamaCppDecoder | None:
        """None when llama.cpp is not built (`native/llamacpp`)."""
        return cls(threads, prompt, model) if LLAMACPP_PYTHON.exists() else None

    def decode(self, n: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return float(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


@contextlib.contextmanager
def compute_timer(backend: Backend):
    """Record how long each ggml graph compute takes while the block runs (the rest of a
    call's wall time is Python and copies). Timed in place: a cached graph's inputs may be
    reused as scratch after the call, so it cannot be recomputed on its own."""
    times: list[float] = []
    real = backend.compute

    def compute(graph) -> None:
        t = time.perf_counter()
        real(graph)
        times.append(time.perf_counter() - t)
    backend.compute = compute  # type: ignore[method-assign]
    try:
        yield times
    finally:
        del backend.compute


def bench_stage(threads: int, n_decode: int, n_prefill: int) -> dict[str, float]:
    stage = Stage.load(bundled_path(), threads=threads, kv=KVSpec(n_slots=2048, dtype="f16"))
    prompt = np.array([1 + (i * 7919) % 40000 for i in range(n_prefill)])

    def prefill() -> None:
        with stage.open_session() as s:
            stage.forward(s, prompt)

    prefill()
    best_prefill = min(timed(prefill, 3))
    with stage.open_session() as s:
        logits = stage.forward(s, prompt[:16])
        stage.forward(s, np.array([int(logits[-1].argmax())]))
        t = time.perf_counter()
        with compute_timer(stage.backend) as computes:
            for _ in range(n_decode):
                logits = stage.forward(s, np.array([int(logits[-1].argmax())]))
        decode = (time.perf_counter() - t) / n_decode
        compute = sum(computes) / n_decode
    stage.close()
    return {"decode": 1 / decode, "prefill": n_prefill / best_prefill,
            "decode_step_ms": decode * 1e3, "decode_overhead_ms": (decode - compute) * 1e3}


def bench_worker(threads: int, embd: int, ff: int, experts: int, used: int) -> list[tuple]:
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "moe.gguf", n_layer=1, n_embd=embd, n_head=8, n_head_kv=4,
                          head_dim=embd // 8, n_expert=experts, n_expert_used=used, n_ff_exp=ff,
                          dtype="q8_0", tied_output=True)
        names = [f"blk.0.{s}" for s in ("ffn_gate_exps.weight", "ffn_up_exps.weight",
                                        "ffn_down_exps.weight")]
        backend = Backend(threads)
        worker = ExpertWorker(load_weights(path, backend, names), backend)
    rng = np.random.default_rng(0)
    rows = []
    for batch in (1, 8, 64, 512):
        x = rng.standard_normal((batch, embd)).astype(np.float32)
        sel = np.stack([rng.choice(experts, used, replace=False) for _ in range(batch)])
        worker(0, x, sel)
        repeat = max(3, min(50, int(2000 / batch)))
        per_call = statistics.median(timed(lambda: worker(0, x, sel), repeat))
        rows.append((batch, per_call))
    x1 = rng.standard_normal((1, embd)).astype(np.float32)
    sel1 = np.arange(used)[None, :]
    worker(0, x1, sel1)
    with compute_timer(backend) as computes:
        calls = timed(lambda: worker(0, x1, sel1), 50)
    call, compute = statistics.median(calls), statistics.median(computes)
    worker.close()
    return rows + [("overhead", call - compute)]


def bench_llamacpp(threads: int, n_decode: int, n_prefill: int) -> dict[str, float] | None:
    if not LLAMACPP_PYTHON.exists():
        return None
    done = subprocess.run([str(LLAMACPP_PYTHON), "-c", _LLAMACPP_SCRIPT, str(bundled_path()),
                           str(threads), str(n_prefill), str(n_decode)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(f"llama.cpp run failed: {done.stderr.strip()[-300:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="0 = one per physical core")
    ap.add_argument("--decode", type=int, default=64, help="decode steps timed")
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens for prefill")
    ap.add_argument("--moe-embd", type=int, default=1024)
    ap.add_argument("--moe-ff", type=int, default=512)
    ap.add_argument("--moe-experts", type=int, default=32)
    ap.add_argument("--moe-used", type=int, default=8)
    args = ap.parse_args()
    threads = compute_threads(args.threads)
    ours = bench_stage(threads, args.decode, args.prefill)
    ref = bench_llamacpp(threads, args.decode, args.prefill)
    worker = bench_worker(threads, args.moe_embd, args.moe_ff, args.moe_experts, args.moe_used)

    def vs(key: str) -> str:
        return f"{ref[key]:10.1f}  {ours[key] / ref[key]:5.2f}x" if ref else f"{'n/a':>10}  {'':6}"

    print(f"\ncompute engine, {threads} threads, bundled SmolLM2-135M Q4_1, KV f16")
    print(f"{'measure':44} {'kvasird':>10} {'llama.cpp':>10}  ratio")
    print(f"{'decode tokens/s':44} {ours['decode']:10.1f} {vs('decode')}")
    label = f"prefill tokens/s ({args.prefill}-token prompt)"
    print(f"{label:44} {ours['prefill']:10.1f} {vs('prefill')}")
    print(f"{'decode step ms':44} {ours['decode_step_ms']:10.3f}")
    print(f"{'decode step Python overhead ms':44} {ours['decode_overhead_ms']:10.3f}")
    moe = (f"expert worker: qwen3moe layer Q8_0, n_embd {args.moe_embd}, n_ff_exp {args.moe_ff}, "
           f"{args.moe_experts} experts, top-{args.moe_used}")
    print(f"\n{moe}")
    print(f"{'batch (tokens)':44} {'ms/call':>10} {'tokens/s':>10}")
    for batch, per_call in worker:
        if batch == "overhead":
            print(f"{'Python overhead per call (batch 1) ms':44} {per_call * 1e3:10.3f}")
        else:
            print(f"{batch:<44} {per_call * 1e3:10.3f} {batch / per_call:10.1f}")
    if ref is None:
        print("\nllama.cpp: not built (run native/llamacpp to build it into .cache/llamacpp-venv)")


if __name__ == "__main__":
    main()

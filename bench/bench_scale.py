"""Real widths: the engine and the ring on models of the shapes hobbyists serve, beside llama.cpp.

    .venv/bin/python bench/bench_scale.py [--quick] [--threads 1] [--tokens 32] [--rounds 5]
                                          [--device CUDA0] [--only ROW ...]

The models are kvasird_dev.benchmodels' (generated once, cached in .cache/bench-models):
``dense`` (Llama-3.2-1B shapes, Q4_K_M) and ``moe`` (Qwen3-30B-A3B shapes, 8 layers,
Q4_K_M). Every row is paired with llama.cpp (llama-cpp-python from .cache/llamacpp-venv)
on the same GGUF and threads, kept loaded in its own process and run right after each of
our runs, so each pair sees the same machine load; a row's ratio is the median of its
pairs' ratios (this machine's speed drifts by 10-20 % from minute to minute).

    1node        one daemon holding the whole dense model: decode tok/s through the admin
                 API's token stream (POST /v0/generate)
    prefill      one stage in process: a 512-token prompt (five paired tries, which goes
                 first alternating: the medians, and the median of the pairs' ratios) and
                 a 4k-token one (one pair; its time to first token), tokens/s; and 16
                 sessions' decode steps as one graph (Stage.forward_batch) against one
                 session's step (what batching them gives the engine, the ceiling of
                 sessions16)
    ring         three daemons holding a third of the dense model's layers each
    moe-ring     the MoE on four daemons: two stages with the dense paths (head on the
                 first) and their layers' experts as a fallback replica, two expert
                 workers with half of every layer's experts each; each stage chooses per
                 layer and step between its copy and the workers by measured round trip
                 and compute ([inference] expert_choice = "auto"), and what it chose is
                 printed per layer
    moe-remote   the same without the stages' copies: every MoE layer's rows go to the
                 workers and back (a stage whose memory holds only the dense path)
    sessions16   aggregate tok/s of 16 concurrent generations on the 1-node daemon (their
                 prompts included: they batch with each other and with the decode steps
                 as they arrive), over one generation's (ours alone: llama-cpp-python
                 decodes one sequence); beside it the same on a daemon that steps each
                 session alone ([inference] batch_sessions = 1, the code before decode
                 batching); and the decode alone: tokens while all 16 decode at once
    prefix-ttft  a 2k-token prompt sent twice to the 1-node daemon: time to first token of
                 the first over the second's (what reusing a prompt's cached prefix buys);
                 then a generation beside a 4k prompt's prefill: the longest wait between
                 its tokens (a stage steps aside between the prompt's 64-row pieces)

and per node: RSS, load seconds per GB of its shard, KV bytes per token; then where a
traced decode step's time went on each route, hop by hop (bench_swarm's breakdown). The
nodes after the first name the model by its id and download only what they hold from the
others, as peers joining a network do. The last line sums it up:

    scale: 1node D.DDx, ring D.DDx, moe-ring D.DDx, moe-remote D.DDx, sessions16 D.DDx,
           prefix-ttft D.DDx
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # kvasird_dev (not installed)

from bench_compute import LLAMACPP_PYTHON, LlamaCppDecoder  # noqa: E402
from bench_daemon import rss_mb  # noqa: E402
from bench_swarm import (  # noqa: E402
    LIVE_TIMING,
    PROMPT,
    _stamps,
    concurrent,
    decode_rates,
    report_breakdowns,
    together,
)

from kvasird.compute.graph import use_device  # noqa: E402
from kvasird.compute.kv.keys import PAGE  # noqa: E402
from kvasird.compute.kv.pool import KVSpec  # noqa: E402
from kvasird.compute.stage import Stage  # noqa: E402
from kvasird.localnet import LocalNet  # noqa: E402
from kvasird.localnet.launcher import LocalNode  # noqa: E402
from kvasird.localnet.placement import parse_hold  # noqa: E402
from kvasird.logs import configure  # noqa: E402
from kvasird.market.model import MarketModel  # noqa: E402
from kvasird.model.manifest import Manifest  # noqa: E402
from kvasird_dev.benchmodels import SPECS, bench_model  # noqa: E402

CACHE = HERE.parent / ".cache"
GB = 2**30
KV_SLOTS = 8192

_LLAMACPP_PREFILL = """
import json, os, sys, time
from llama_cpp import Llama
path, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=n + 64, n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False,
            n_gpu_layers=int(os.environ.get("KVASIR_LLAMACPP_GPU_LAYERS", "0")))
prompt = [1 + (i * 7919) % 40000 for i in range(n)]
llm.eval(prompt[:8]); llm.reset()
t = time.perf_counter(); llm.eval(prompt); print(json.dumps(time.perf_counter() - t))
"""


def prompt_of(n: int, salt: int = 0) -> list[int]:
    """A deterministic n-token prompt; another salt shares no prefix with it."""
    return [1 + (i * 7919 + salt) % 40000 for i in range(n)]


def decode_together(node: LocalNode, sessions: int, n: int) -> float:
    """Aggregate decode tok/s while `sessions` generations all decode at once: the token
    events between the last one's first token and the first one's last (their prompts
    left out)."""
    stamps, _ = together(node, sessions, n)
    lo, hi = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    return sum(lo < t <= hi for s in stamps for t in s) / (hi - lo) if hi > lo else 0.0


def decode_beside_prefill(node: LocalNode, n: int, tokens: int) -> tuple[float, float, float]:
    """A generation's token events while another request prefills an n-token prompt on the
    same daemon: (longest gap between two of them, their median gap, s) and the prefill's
    time to first token (s): how long a long prompt holds up the decode steps of others."""
    done: list[float] = []
    prefill = threading.Thread(target=lambda: done.append(first_token(node, prompt_of(n, 1))[0]))
    prefill.start()
    stamps = _stamps(node, PROMPT, tokens)
    prefill.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return max(gaps), statistics.median(gaps), done[0]


def llamacpp_prefill_s(model: Path, threads: int, n: int) -> float | None:
    if not LLAMACPP_PYTHON.exists():
        return None
    out = subprocess.run([str(LLAMACPP_PYTHON), "-c", _LLAMACPP_PREFILL, str(model),
                          str(threads), str(n)], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def prefill(model: Path, threads: int, sizes: list[int]) -> dict[str, Any]:
    """Our prefill seconds per prompt size (in process), llama.cpp's right after each; the
    load time, and the KV bytes per token of the whole model."""
    began = time.perf_counter()
    stage = Stage.load(model, threads=threads, kv=KVSpec(n_slots=max(sizes) + 64))
    out: dict[str, Any] = {"load_s_per_gb": (time.perf_counter() - began)
                           / (model.stat().st_size / GB)}
    out["kv_bytes_per_token"] = kv_bytes_per_token(stage)
    with stage.open_session() as s:
        stage.forward(s, np.array(prompt_of(8)))  # graphs of the small sizes, threads warm
    sessions = [stage.open_session() for _ in range(16)]  # one session's step, and 16's
    for i, s in enumerate(sessions):
        stage.forward(s, np.array(prompt_of(64 + i)))
    cost = {}
    for n in (1, 16) * 5:  # the least of five each: a step is 30-250 ms on a noisy machine
        steps = [(s, np.array([7]), s.n_past) for s in sessions[:n]]
        t = time.perf_counter()
        stage.forward_batch(steps)
        cost[n] = min(cost.get(n, 1e9), time.perf_counter() - t)
    out["batch16"] = 16 * cost[1] / cost[16]
    for s in sessions:
        s.close()
    def ours(n: int) -> float:
        with stage.open_session() as s:
            t = time.perf_counter()
            stage.forward(s, np.array(prompt_of(n)))
            return time.perf_counter() - t

    for n in sizes:  # paired tries, which goes first alternating; a short prompt five times
        pairs = []
        for i in range(5 if n <= 512 else 1):
            if i % 2:  # llama.cpp first
                b = llamacpp_prefill_s(model, threads, n)
                a = ours(n)
            else:
                a = ours(n)
                b = llamacpp_prefill_s(model, threads, n)
            pairs.append((a, b))
        known = [(a, b) for a, b in pairs if b is not None]
        out[n] = (statistics.median(a for a, _ in pairs),
                  statistics.median(b for _, b in known) if known else None,
                  statistics.median(b / a for a, b in known) if known else None)
    stage.close()
    return out


def kv_bytes_per_token(stage: Stage) -> float:
    pool = stage.kv
    per_slot = sum(int(t.contents.ne[0]) for t in pool.k.values())  # K: kv_dim per slot
    per_slot += sum(int(t.contents.ne[0]) // PAGE for t in pool.v.values())  # V: [PAGE kv_dim]
    return per_slot * (2 if pool.spec.dtype == "f16" else 4)


def start(root: Path, model: Path, manifest: Manifest, placement: list[list[str]],
          threads: int, **extra: Any) -> LocalNet:
    """Node i holds placement[i]; nodes after the first fetch their units from the others;
    `extra` settings for every node (dotted keys)."""
    mm = MarketModel.from_manifest(manifest)
    net = LocalNet(root, len(placement))
    previous = ""
    for node, pins in zip(net.nodes, placement, strict=True):
        held = {u for p in pins for u in parse_hold(p)}
        budget = int(sum(mm.size(u) for u in held) / 2**20) + 1
        net.settings = {
            **net.settings, "market.model": str(model) if node.index == 0 else manifest.model_id,
            "market.hold": pins, "market.memory_budget_mb": budget, "market.enroll_delay_s": 0.0,
            "market.target_replicas": 1, "compute.threads": threads,
            "inference.kv_slots": KV_SLOTS, "inference.step_timeout_s": 120.0,
            "inference.expert_timeout_s": 60.0, **LIVE_TIMING, **extra}
        previous = net.configure(node, [previous] if previous else [])
    for node in net.nodes:
        node.spawn()
    for node in net.nodes:
        node.wait_ready()
    net.wait_until("a route", lambda: _stamps(net.nodes[0], [1], 1) != [], 900)
    return net


def first_token(node: LocalNode, prompt: list[int]) -> tuple[float, str]:
    """Seconds from sending ``prompt`` to its first token event, and that event's line
    (the token with its logprob and top 5: equal lines are equal numbers, bit for bit)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5}
    began = time.perf_counter()
    with httpx.stream("POST", node.home.admin_address() + "/v0/generate", json=body,
                      timeout=600) as resp:
        for line in resp.iter_lines():
            if '"token"' in line:
                return time.perf_counter() - began, line
    return float("nan"), ""


def experts(n_layer: int, lo: int, hi: int) -> list[str]:
    return [f"experts:{layer}:{lo}-{hi}" for layer in range(n_layer)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and tokens (CI size)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per daemon and "
                    "for llama.cpp (1: on a shared 2-core machine two ggml threads stall each "
                    "other at every barrier)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per generation")
    ap.add_argument("--rounds", type=int, default=5, help="paired decode runs per layout")
    ap.add_argument("--device", default="", help="ggml device for our stages and daemons "
                    "([compute] device, e.g. CUDA0; llama.cpp offloads its layers when "
                    "KVASIR_LLAMACPP_GPU_LAYERS=-1)")
    ap.add_argument("--only", nargs="*", default=[], help="rows to run (1node ring moe-ring "
                    "moe-remote "
                    "prefill prefix-ttft beside); the 1node daemon also gives sessions16, "
                    "prefix-ttft and beside")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.rounds = min(args.tokens, 16), min(args.rounds, 3)
    configure("warning", json=False)
    use_device(args.device)
    want = set(args.only or ["prefill", "1node", "ring", "moe-ring", "moe-remote"])
    dense, moe = bench_model(CACHE, "dense"), bench_model(CACHE, "moe")
    nl, nm = SPECS["dense"].n_layer, SPECS["moe"].n_layer
    rows: list[tuple[str, str, str, str]] = []
    summary: dict[str, float] = {}
    node_rows: list[tuple[str, float, float]] = []
    engine: tuple[float, float] | None = None
    breakdowns: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
    choices: dict[str, list[dict[str, dict[str, int]]]] = {}

    def row(name: str, ours: str, theirs: str, ratio: float | None) -> None:
        rows.append((name, ours, theirs, f"{ratio:.2f}x" if ratio is not None else "n/a"))
        print(f"{name}: {ours} vs {theirs}", flush=True)

    if "prefill" in want:
        sizes = [512, 4096]
        p = prefill(dense, args.threads, sizes)
        for n in sizes:
            ours, theirs, ratio = p[n]
            row(f"dense prefill {n} tok/s", f"{n / ours:.1f}",
                f"{n / theirs:.1f}" if theirs else "n/a", ratio)
            if n == 4096:
                row("dense 4k prompt: time to first token s", f"{ours:.1f}",
                    f"{theirs:.1f}" if theirs else "n/a", ratio)
        engine = (p["load_s_per_gb"], p["kv_bytes_per_token"])
        row("dense: 16 sessions' decode steps in one graph, tokens/s over one session's "
            "step (the ceiling of sessions16)", f"{p['batch16']:.2f}x", "", None)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        root = Path(tmp)
        layouts = [
            ("1node", dense, [["head", f"layers:0-{nl}"]]),
            ("ring", dense, [["head", f"layers:0-{nl // 3}"],
                             [f"layers:{nl // 3}-{2 * nl // 3}"], [f"layers:{2 * nl // 3}-{nl}"]]),
            ("moe-ring", moe, [["head", f"layers:0-{nm // 2}", *experts(nm // 2, 0, 128)],
                               [f"layers:{nm // 2}-{nm}", *experts(nm, 0, 128)[nm // 2:]],
                               experts(nm, 0, 64), experts(nm, 64, 128)]),
            ("moe-remote", moe, [["head", f"layers:0-{nm // 2}"], [f"layers:{nm // 2}-{nm}"],
                                 experts(nm, 0, 64), experts(nm, 64, 128)]),
        ]
        refs: dict[Path, LlamaCppDecoder | None] = {}
        runs = {n for n, _, _ in layouts
                if n in want or n == "1node" and want & {"prefix-ttft", "beside"}}
        manifests = {m: Manifest.from_gguf(m) for m in {d for n, d, _ in layouts if n in runs}}
        for name, model, placement in layouts:
            if name not in runs:
                continue
            began = time.perf_counter()
            with start(root / name, model, manifests[model], placement, args.threads,
                       **{"compute.device": args.device}) as net:
                up = time.perf_counter() - began
                for node, pins in zip(net.nodes, placement, strict=True):
                    assert node.proc is not None
                    node_rows.append((f"{name} node{node.index} ({', '.join(pins)[:40]})",
                                      rss_mb(node.proc.pid), up))
                if name in want:
                    if model not in refs:
                        refs[model] = LlamaCppDecoder.start(args.threads, PROMPT, model)
                    ours, theirs, _ = decode_rates(net.nodes[0], args.tokens, args.rounds,
                                                   refs[model])
                    ratio = statistics.median(o / r for o, r in zip(ours, theirs, strict=True)) \
                        if theirs else None
                    row(f"{name} decode tok/s", f"{statistics.median(ours):.1f}",
                        f"{statistics.median(theirs):.1f}" if theirs else "n/a", ratio)
                    summary[name] = ratio or 0.0
                    names = {n.peer_id: f"node{n.index}" for n in net.nodes}
                    breakdowns[name] = (net.nodes[0].get("/v0/inference")["breakdown"], names)
                    if name.startswith("moe"):
                        choices[name] = [n.get("/v0/inference")["expert_choice"]["layers"]
                                         for n in net.nodes[:2]]
                if name == "1node" and "1node" in want:
                    one = concurrent(net.nodes[0], 1, args.tokens)
                    b0 = net.nodes[0].get("/v0/inference")["serving"]["batches"]
                    many = concurrent(net.nodes[0], 16, args.tokens)
                    b1 = net.nodes[0].get("/v0/inference")["serving"]["batches"]
                    steps = (b1["rows"] - b0["rows"]) / max(b1["batches"] - b0["batches"], 1)
                    row(f"1node 16 sessions: aggregate tok/s (vs one session; batches of "
                        f"{steps:.1f} steps, {b1['prompts'] - b0['prompts']} prompts batched)",
                        f"{many:.1f}", f"{one:.1f}", many / one)
                    summary["sessions16"] = many / one
                    alone, _, _ = decode_rates(net.nodes[0], 3 * args.tokens, 1, None)
                    together = decode_together(net.nodes[0], 16, 3 * args.tokens)
                    row("1node 16 sessions decoding at once: aggregate decode tok/s (vs one "
                        "session's decode; the prompts left out)",
                        f"{together:.1f}", f"{alone[0]:.1f}", together / alone[0])
                    with start(root / "1node-solo", model, manifests[model], placement,
                               args.threads, **{"inference.batch_sessions": 1,
                                                "compute.device": args.device}) as solo:
                        one_s = concurrent(solo.nodes[0], 1, args.tokens)
                        many_s = concurrent(solo.nodes[0], 16, args.tokens)
                    row("1node 16 sessions, each step alone (batch_sessions 1): aggregate "
                        "tok/s (vs one session)", f"{many_s:.1f}", f"{one_s:.1f}", many_s / one_s)
                if name == "1node" and want & {"1node", "prefix-ttft"}:
                    long = prompt_of(2048)
                    (c, cold), (w, warm) = (first_token(net.nodes[0], long),
                                            first_token(net.nodes[0], long))
                    same = "the same logprobs" if warm == cold else "OTHER LOGPROBS"
                    row(f"1node 2k prompt sent again: TTFT s (first vs again; {same})",
                        f"{w:.2f}", f"{c:.2f}", c / w)
                    summary["prefix-ttft"] = c / w
                    # an agent's next call: the same 2k start, a new 64-token turn after it
                    turn = long + prompt_of(2048 + 64)[2048:]
                    t, _ = first_token(net.nodes[0], turn)
                    row("1node 2k prompt + a new 64-token turn: TTFT s (vs the 2k cold)",
                        f"{t:.2f}", f"{c:.2f}", c / t)
                if name == "1node" and want & {"1node", "beside"}:
                    worst, typical, ttft = decode_beside_prefill(net.nodes[0], 4096, args.tokens)
                    row("1node decode beside a 4k prompt's prefill: longest gap between tokens "
                        f"s (vs the median gap; the prompt's first token after {ttft:.0f} s)",
                        f"{worst:.2f}", f"{typical:.2f}", None)
        for ref in refs.values():
            if ref is not None:
                ref.close()
    print(f"\n## Real widths (threads {args.threads}, {args.tokens} decode tokens, "
          f"{args.rounds} paired rounds)\n")
    print("| measurement | kvasird | llama.cpp (or the baseline) | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\n| node | RSS MB | network up after s |")
    print("|---|---|---|")
    for name, a, b in node_rows:
        print(f"| {name} | {a:.0f} | {b:.0f} |")
    if engine:
        print(f"\none stage holding the dense model: load {engine[0]:.2f} s/GB, "
              f"KV {engine[1]:.0f} bytes/token (f16)")
    report_breakdowns(breakdowns)  # where a ring's step goes, hop by hop
    report_choices(choices)
    print("\nscale: " + ", ".join(f"{k} {summary[k]:.2f}x" for k in
                                  ("1node", "ring", "moe-ring", "moe-remote", "sessions16",
                                   "prefix-ttft")
                                  if k in summary))


def report_choices(choices: dict[str, list[dict[str, dict[str, int]]]]) -> None:
    """Per MoE layer, how the stage holding it computed its steps' experts: its own copy
    (fallback), the workers (remote) or its hot-expert cache."""
    if not choices:
        return
    print("\n## Where each MoE layer's experts were computed (steps per choice, each stage)\n")
    print("| layout | layer | fallback | remote | cache |")
    print("|---|---|---|---|---|")
    for name, stages in choices.items():
        for layers in stages:
            for layer, c in sorted(layers.items(), key=lambda kv: int(kv[0])):
                print(f"| {name} | {layer} | {c.get('fallback', 0)} | {c.get('remote', 0)} "
                      f"| {c.get('cache', 0)} |")


if __name__ == "__main__":
    main()

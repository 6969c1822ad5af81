"""Gateway overhead: time to first token and tokens/s, through HTTP vs in-process, 1/4/16 clients.

    nice .venv/bin/python bench/bench_gateway.py [--threads 1] [--tokens 64] [--clients 1 4 16]

In-process: LocalGenerator.generate on the bundled SmolLM2-135M (the path the gateway
calls), N generations at once in one trio loop. HTTP: one real daemon (LocalNet, the
same model) and N concurrent streaming OpenAI chat requests parsed from the raw SSE;
first with ``[gateway] local = true`` (LocalGenerator), then with the swarm generator
routing over the daemon itself (it enrolls in every unit). Every generation runs
exactly --tokens tokens (greedy, ``ignore_eos``), on the same chat prompt. TTFT is from
sending the request to the first token (first content delta over HTTP); per-stream tok/s
is (tokens - 1) / (last - first token); aggregate tok/s is all tokens / wall time of the
batch. Concurrent local generations share one ggml stage and take turns token by token
(a FIFO lock), so the aggregate stays near the single-stream rate and the per-stream
rate divides by N.

--threads defaults to 1: on a busy 2-core machine two ggml threads stall each other
(86 vs 6.5 tokens/s measured side by side in one run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from kvasird.compute.sampling import SamplingParams
from kvasird.inference.api import Finished, GenerationRequest, Sampling
from kvasird.inference.local import LocalGenerator
from kvasird.localnet import LocalNet
from kvasird.model.bundled import bundled_path
from kvasird.text.chat import ChatTemplate, Message
from kvasird.text.tokenizer import Tokenizer

SYSTEM = "You are a helpful assistant."
QUESTION = "Write a short story about a dragon who learns to bake bread."


@dataclass(frozen=True)
class Run:
    ttft_s: float
    """Request sent -> first token."""
    tokens: int
    """Tokens received."""
    decode_s: float
    """First token -> last token."""


@dataclass(frozen=True)
class Row:
    path: str
    clients: int
    runs: list[Run]
    wall_s: float

    def cells(self) -> list[str]:
        ttft = statistics.median(r.ttft_s for r in self.runs) * 1000
        per = statistics.median((r.tokens - 1) / r.decode_s for r in self.runs if r.decode_s > 0)
        total = sum(r.tokens for r in self.runs)
        return [self.path, str(self.clients), f"{ttft:.1f}", f"{per:.1f}",
                f"{total / self.wall_s:.1f}"]


async def in_process(gen: LocalGenerator, prompt: list[int], n: int, clients: int) -> Row:
    runs: list[Run] = []

    async def one() -> None:
        req = GenerationRequest(gen.info.model_id, tuple(prompt),
                                Sampling(SamplingParams(temperature=0.0), n))
        t0 = trio.current_time()
        first = last = t0
        count = 0
        async for event in gen.generate(req):
            if isinstance(event, Finished):
                continue
            last = trio.current_time()
            first = last if count == 0 else first
            count += 1
        runs.append(Run(first - t0, count, last - first))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(one)
    return Row("in-process", clients, runs, time.perf_counter() - start)


def over_http(url: str, model: str, n: int, clients: int) -> Row:
    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": n, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": QUESTION}],
            "stream_options": {"include_usage": True}}

    def one(_: int) -> Run:
        t0 = time.perf_counter()
        first = last = t0
        tokens = 0
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    first = last if first == t0 else first
        return Run(first - t0, tokens, last - first)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(one, range(clients)))
    return Row("HTTP", clients, runs, time.perf_counter() - start)


def daemon_rows(path: Path, args: argparse.Namespace, local: bool) -> list[Row]:
    """HTTP rows against one daemon: LocalGenerator (local) or SwarmGenerator over itself."""
    name = "HTTP, local" if local else "HTTP, swarm (1 node)"
    with tempfile.TemporaryDirectory() as tmp, LocalNet(Path(tmp), 1, settings={
            "market.model": str(path), "gateway.local": local, "compute.threads": args.threads,
            "market.memory_budget_mb": 200, "market.target_replicas": 1,
            "market.heartbeat_s": 1.0, "market.enroll_delay_s": 0.0,
            "inference.kv_slots": 8192, "gateway.max_concurrent": max(args.clients)}) as net:
        net.up()
        url = net.nodes[0].status()["gateway"]
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.1)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        while over_http(url, model, 4, 1).runs[0].tokens == 0:  # 503 until a route exists
            time.sleep(0.5)
        return [dataclasses.replace(over_http(url, model, args.tokens, c), path=name)
                for c in args.clients]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    path = bundled_path()
    tok = Tokenizer.from_gguf(path)
    prompt = tok.encode(ChatTemplate.of(tok).render(
        [Message("system", SYSTEM), Message("user", QUESTION)]), special=True)
    rows: list[Row] = []

    gen = LocalGenerator.open(path, "bench", "smollm2", threads=args.threads, kv_tokens=8192)
    try:
        trio.run(in_process, gen, prompt, 4, 1)  # warm the graph cache
        for c in args.clients:
            rows.append(trio.run(in_process, gen, prompt, args.tokens, c))
    finally:
        gen.close()

    for local in (True, False):
        rows += daemon_rows(path, args, local)

    head = ["path", "clients", "TTFT ms (median)", "tok/s per stream (median)", "tok/s aggregate"]
    print(f"\nbundled SmolLM2-135M Q4_1, prompt {len(prompt)} tokens, {args.tokens} tokens per "
          f"generation, {args.threads} ggml thread(s)\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")


if __name__ == "__main__":
    main()

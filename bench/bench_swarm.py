"""Generation across daemons on loopback: ring decode, remote experts, per-hop cost, concurrency.

    .venv/bin/python bench/bench_swarm.py [--tokens 64] [--rounds 7] [--threads 1]

Real daemons (kvasird.localnet) with pinned placement, greedy decode through the admin
API's token stream (POST /v0/generate): decode tok/s is measured between the first and
the last token event at the client, the median of --rounds runs. llama.cpp stays loaded
in a process of its own and decodes as many tokens right after each of our runs: on a
small shared machine whose speed drifts by 10-20 % from minute to minute, the ratio of
each such pair is what can be compared, and the table gives their median. Side by side:

    1 node          one daemon holding the whole bundled model (SmolLM2-135M Q4_1)
    3-stage ring    three daemons holding a third of the layers each (head on the first)
    MoE 1 node      a generated qwen3moe on one daemon
    MoE + experts   the same model: two stages holding the dense paths, two expert workers
                    (and again with the stages' hot-expert cache on)
    llama.cpp       monolithic, same GGUF and threads (when native/llamacpp was built)

then where a traced decode step's time went on each measured route, per hop (queue,
compute, after) and on the wire (kvasird.inference.steptrace, from the gateway's admin
API); then the per-hop overhead, measured in process on the bundled model's shapes (one hidden
row of 576 floats): serialization (encode + msgpack + decode), a libp2p round trip over
one long-lived stream (TCP + Noise + yamux, two hosts in one process), the stage
handler's Python, the compute of one third of the layers, and a decode step's compute as
one graph vs the ring's four; and aggregate tok/s with
1, 4 and 16 concurrent sessions on the ring and on the MoE ring (expert rows per worker
call shows what batching across sessions buys).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvasird_dev (not installed)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))

from bench_compute import LlamaCppDecoder  # noqa: E402
from test_swarm import experts, settings  # noqa: E402

from kvasird.compute.experts import ExpertShard, dispatch  # noqa: E402
from kvasird.compute.kv.pool import KVSpec  # noqa: E402
from kvasird.compute.stage import Stage  # noqa: E402
from kvasird.inference.protocol import tensors  # noqa: E402
from kvasird.inference.server.engine import Holdings, Served  # noqa: E402
from kvasird.inference.server.stage import StageServer  # noqa: E402
from kvasird.inference.transport.channel import Channels, serve  # noqa: E402
from kvasird.inference.transport.lane import LaneServer  # noqa: E402
from kvasird.localnet import LocalNet  # noqa: E402
from kvasird.localnet.launcher import LocalNetError, LocalNode  # noqa: E402
from kvasird.logs import configure  # noqa: E402
from kvasird.model.bundled import bundled_path  # noqa: E402
from kvasird.wire import pack, unpack  # noqa: E402
from kvasird.wire.rpc import MAX_FRAME  # noqa: E402
from kvasird_dev.testmodels import make_model  # noqa: E402

PROMPT = [1, 504, 3458, 282, 4649, 314, 28, 1834]


LIVE_TIMING = {"market.heartbeat_s": 5.0, "market.rebalance_s": 15.0}
"""The daemon's defaults: the tests' fast heartbeats (0.5 s) would add gossip work that a
node in use does not do, on the cores the decode runs on."""


def start(root: Path, model: Path, placement: list[list[str]], threads: int,
          extra: dict[str, Any]) -> LocalNet:
    net = LocalNet(root, len(placement))
    previous = ""
    for node, pins in zip(net.nodes, placement, strict=True):
        net.settings = {**net.settings, **settings(model, pins, **{
            "compute.threads": threads, **LIVE_TIMING, **extra})}
        previous = net.configure(node, [previous] if previous else [])
    for node in net.nodes:
        node.spawn()
    for node in net.nodes:
        node.wait_ready()
    net.wait_until("a route", lambda: _generate(net.nodes[0], [1], 1)[0] == 1, 120)
    try:  # a lane whose first attempt failed is asked for again on a use, seconds later
        net.wait_until("every hop on a lane", lambda: _generate(net.nodes[0], PROMPT, 8)[0] > 0
                       and not any(n.get("/v0/inference")["lanes"]["libp2p_to"]
                                   for n in net.nodes), 30)
    except LocalNetError:
        names = {n.peer_id: f"node{n.index}" for n in net.nodes}
        stuck = [f"node{n.index} -> {names.get(p, p)}" for n in net.nodes
                 for p in n.get("/v0/inference")["lanes"]["libp2p_to"]]
        print(f"warning: no lane within 30 s for {', '.join(stuck)}: those hops stay on "
              "libp2p", flush=True)
        for n in net.nodes:  # why, from their logs
            for line in [ln for ln in n.tail(400).splitlines() if "no lane" in ln][-3:]:
                print(f"  node{n.index}: {line[:300]}", flush=True)
    return net


def _stamps(node: LocalNode, prompt: list[int], n: int) -> list[float]:
    """When each token event of a greedy generation reached the client."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    stamps: list[float] = []
    with httpx.stream("POST", node.home.admin_address() + "/v0/generate", json=body,
                      timeout=600) as resp:
        if resp.status_code != 200:
            return []
        for line in resp.iter_lines():
            if '"token"' in line:
                stamps.append(time.perf_counter())
    return stamps


def _generate(node: LocalNode, prompt: list[int], n: int) -> tuple[int, float]:
    """(tokens, decode seconds between the first and the last token event)."""
    stamps = _stamps(node, prompt, n)
    return len(stamps), (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def decode_rates(node: LocalNode, n: int, rounds: int, ref: LlamaCppDecoder | None
                 ) -> tuple[list[float], list[float], list[float]]:
    """Our decode tok/s per round; when `ref` is given, llama.cpp's measured right after each
    of ours (the same machine load for both: the ratio is taken per round); and the gaps
    between token events at the client (s), which show whether tokens stream evenly."""
    _generate(node, PROMPT, n)  # warm: lanes up, graphs built
    ours, theirs, gaps = [], [], []
    for _ in range(rounds):
        stamps = _stamps(node, PROMPT, n)
        ours.append((len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0)
        gaps += [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        if ref is not None:
            theirs.append(ref.decode(n))
    return ours, theirs, gaps


def together(node: LocalNode, sessions: int, n: int) -> tuple[list[list[float]], float]:
    """`sessions` generations of n tokens at once: each one's token stamps (_stamps), and
    the seconds from starting them to the last one's end."""
    stamps: list[list[float]] = [[] for _ in range(sessions)]

    def one(i: int) -> None:
        stamps[i] = _stamps(node, [PROMPT[i % len(PROMPT)], *PROMPT[:4]], n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(sessions)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stamps, time.perf_counter() - began


def concurrent(node: LocalNode, sessions: int, n: int) -> float:
    """Aggregate generated tokens per second with `sessions` generations at once."""
    stamps, seconds = together(node, sessions, n)
    return sum(len(s) for s in stamps) / seconds


def sent_rows(net: LocalNet) -> tuple[int, int]:
    """(expert messages, rows in them) the stages have sent so far."""
    calls = rows = 0
    for node in net.nodes:
        stats = node.get("/v0/inference")["dispatch"]
        calls, rows = calls + stats.get("calls", 0), rows + stats.get("rows", 0)
    return calls, rows


def concurrency(net: LocalNet, sessions: list[int], n: int) -> dict[int, tuple[float, float]]:
    """Per session count: aggregate tokens/s, and rows per expert message the stages sent."""
    out = {}
    for s in sessions:
        calls, rows = sent_rows(net)
        rate = concurrent(net.nodes[0], s, n)
        calls2, rows2 = sent_rows(net)
        out[s] = (rate, (rows2 - rows) / max(calls2 - calls, 1))
    return out


def expert_batching(net: LocalNet, workers: list[int]) -> str:
    rows = calls = 0
    for i in workers:
        view = net.nodes[i].get("/v0/inference")["serving"]
        rows, calls = rows + view["expert_rows"], calls + view["expert_calls"]
    return f"{rows / max(calls, 1):.2f} rows/call"


def median_ms(fn: Callable[[], object], n: int, idle_s: float = 0.0) -> float:
    """Median ms of fn over n calls; with `idle_s`, the process sleeps that long before
    each, as a ring stage does while the other stages compute: on this VM the same graph
    then runs 10-15 % slower than back to back (the core's idle and wake-up, not cache
    misses: nothing else runs meanwhile)."""
    times = []
    for _ in range(n):
        if idle_s:
            time.sleep(idle_s)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def per_hop(bundled: Path, threads: int) -> list[tuple[str, float]]:
    """Per-hop costs on the bundled model's shapes, in milliseconds."""
    rows: list[tuple[str, float]] = []
    x = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32)
    msg = {"op": "step", "sid": "s.1", "start": 10, "x": tensors.encode(x, "f32"), "id": 1}
    rows.append(("serialization: encode + msgpack + decode, 1 row",
                 median_ms(lambda: tensors.decode(unpack(pack({**msg, "x": tensors.encode(
                     x, "f32")}))["x"], "x", ("f32",), (None, 576)), 2000)))
    stage = Stage.load(bundled, (0, 10), embed=False, head=False, threads=threads,
                       kv=KVSpec(n_slots=4096, dtype="f32"))
    session = stage.open_session()
    stage.forward(session, np.repeat(x, 8, axis=0))
    rows.append(("compute: 10 layers, 1 token",
                 median_ms(lambda: (stage.forward(session, x, 8), session.truncate(8)), 200)))
    rows.append(("compute: 10 layers, 1 token, each after 5 ms idle (as a ring stage's)",
                 median_ms(lambda: (stage.forward(session, x, 8), session.truncate(8)), 100,
                           idle_s=0.005)))
    stage.close()
    rows += split_compute(bundled, threads)
    one, ids = np.ones((1, 128), np.float32), np.array([[1, 6]])
    def zeros(layer: int, r: np.ndarray, sel: np.ndarray) -> np.ndarray:
        return np.zeros((len(r), sel.shape[1], 128), np.float32)

    shards = [ExpertShard(a, b, zeros) for a, b in ((0, 4), (4, 8))]
    rows.append(("expert dispatch of one row to 2 shards (k=2), Python only",
                 median_ms(lambda: dispatch(0, one, ids, shards), 5000)))
    served = Served.build([bundled], Holdings(windows=((0, 10),)), threads=threads,
                          kv_slots=4096, remote=lambda *a: None)  # type: ignore[arg-type,return-value]
    server = StageServer(lambda: "m", lambda: served, max_sessions=4, idle_s=60,
                         wire_dtype="f32")

    async def handler_cost() -> float:
        await server.handle("g", {"op": "open", "sid": "s", "model": "m", "first": 0, "end": 10,
                                  "embed": False, "head": False, "max_tokens": 4096,
                                  "logprobs": 0})
        step = {"op": "step", "sid": "s", "start": 0, "x": tensors.encode(x, "f32")}
        times = []
        for _ in range(200):
            t = time.perf_counter()
            await server.handle("g", step)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000

    total = trio.run(handler_cost)
    served.close()
    rows.append(("stage handler total (compute + thread hop + Python)", total))
    rows.append(("libp2p round trip, 2.3 KB each way, one stream", trio.run(rtt, False)))
    rows.append(("lane round trip (direct TCP, sealed), 2.3 KB each way", trio.run(rtt, True)))
    return rows


def split_compute(bundled: Path, threads: int, n: int = 100) -> list[tuple[str, float]]:
    """A decode step's compute as one graph of the whole model vs the ring's four (three
    windows, then the head), in one process: what splitting costs in compute alone."""
    kv = KVSpec(n_slots=512, dtype="f16")
    layouts = {"compute: whole model, one graph, 1 token": [((0, 30), True, True)],
               "compute: the ring's 4 graphs (3 windows + head), 1 token":
                   [((0, 10), True, False), ((10, 20), False, False), ((20, 30), False, False),
                    ((30, 30), False, True)]}
    rows = []
    for name, parts in layouts.items():
        stages = [Stage.load(bundled, w, embed=e, head=h, threads=threads, kv=kv)
                  for w, e, h in parts]
        chain = [(st, st.open_session()) for st in stages]
        _through(chain, np.asarray(PROMPT, np.int32), 0)
        token = np.asarray([1], np.int32)
        times = []
        for i in range(n):
            t = time.perf_counter()
            _through(chain, token, len(PROMPT) + i)
            times.append(time.perf_counter() - t)
        rows.append((name, statistics.median(times) * 1000))
        for st in stages:
            st.close()
    return rows


def _through(chain: list[tuple[Stage, Any]], x: np.ndarray, start: int) -> np.ndarray:
    for stage, session in chain:
        x = stage.forward(session, x, start)
    return x


def wire_f16_effect(bundled: Path, threads: int, n: int) -> dict[str, float]:
    """Greedy decode over three windows with the boundaries rounded to f16, vs f32 (exact)."""
    stages = [Stage.load(bundled, (a, b), embed=a == 0, head=b == 30, threads=threads,
                         kv=KVSpec(n_slots=1024, dtype="f32")) for a, b in ((0, 10), (10, 20),
                                                                           (20, 30))]
    runs = {}
    for dt in ("f32", "f16"):
        sessions = [st.open_session() for st in stages]
        tokens, logits, x_in, start = [], [], np.asarray(PROMPT), 0
        for _ in range(n):
            x = x_in
            for st, se in zip(stages, sessions, strict=True):
                x = st.forward(se, x, start)
                if not st.head:
                    x = tensors.decode(tensors.encode(x, dt), "x", (dt,), (None, 576))
            logits.append(x[-1])
            start += len(x_in)
            tokens.append(int(x[-1].argmax()))
            x_in = np.array([tokens[-1]])
        runs[dt] = (tokens, np.array(logits))
        for se in sessions:
            se.close()
    for st in stages:
        st.close()
    (t32, l32), (t16, l16) = runs["f32"], runs["f16"]
    same = next((i for i, (a, b) in enumerate(zip(t32, t16, strict=True)) if a != b), n)
    upto = max(same, 1)
    return {"max_abs_logit_delta": float(np.abs(l32[:upto] - l16[:upto]).max()),
            "logit_scale": float(np.abs(l32).max()), "first_divergence": same, "tokens": n}


async def rtt(lanes: bool) -> float:
    """Median request round trip between two hosts in this process, over libp2p or a lane."""
    import multiaddr
    from libp2p.peer.peerinfo import PeerInfo

    from kvasird.identity.nodekey import create_node_key
    from kvasird.p2p.host import build_host, parse_listen

    async def echo(caller: str, m: dict[str, Any]) -> dict[str, Any]:
        return {"x": m["x"]}

    payload = tensors.encode(np.zeros((1, 576), np.float32), "f32")
    with tempfile.TemporaryDirectory() as tmp:
        async with AsyncExitStack() as stack:
            hosts = []
            for i in range(2):
                listen = parse_listen(("/ip4/127.0.0.1/tcp/0",))
                host = build_host(create_node_key(Path(tmp) / f"{i}.key"), listen, [], 8)
                await stack.enter_async_context(host.run([multiaddr.Multiaddr(a) for a in listen]))
                stack.push_async_callback(_close_peers, host)
                hosts.append(host)
            await hosts[0].connect(PeerInfo(hosts[1].get_id(), hosts[1].get_addrs()))
            server = LaneServer("127.0.0.1", 0, MAX_FRAME)
            server.register("/bench/1", lambda s, peer: serve(s, echo, 60, peer=peer))
            hosts[1].set_stream_handler("/bench/1", lambda s: serve(
                s, echo, 60, lanes=server, protocol="/bench/1"))
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                channels = Channels(hosts[0], lanes=lanes)
                await nursery.start(channels.run)
                peer = hosts[1].get_id().to_string()
                await channels.request(peer, "/bench/1", {"x": payload}, 5)
                with trio.fail_after(5):
                    while lanes and not channels.lane_open(peer, "/bench/1"):
                        await trio.sleep(0.01)
                times = []
                for _ in range(300):
                    t = time.perf_counter()
                    await channels.request(peer, "/bench/1", {"x": payload}, 5)
                    times.append(time.perf_counter() - t)
                nursery.cancel_scope.cancel()
    return statistics.median(times[20:]) * 1000


def report_breakdowns(breakdowns: dict[str, tuple[dict[str, Any], dict[str, str]]]) -> None:
    """Where the traced decode steps' time went, hop by hop, on the routes measured."""
    shown = {k: v for k, v in breakdowns.items() if v[0] and len(v[0]["hops"]) > 1}
    if not shown:
        return
    print("\n## Per-hop breakdown on the real route (traced decode steps, medians, ms)\n")
    print("queue: frame read -> compute (Python dispatch, decoding the step); compute: "
          "the stage's graphs and, of that, the wait for remote experts; after: encode or "
          "sample -> handed to the transport; wire: the rest of the step (framing, "
          "encryption, loopback, each receiver waking up)\n")
    print("| layout | hop | queue | compute | of which remote experts | after |")
    print("|---|---|---|---|---|---|")
    for name, (view, names) in shown.items():
        for i, hop in enumerate(view["hops"]):
            label = names.get(hop["peer"], hop["peer"][-6:])
            print(f"| {name} | {i}: {label} | {hop['queue_ms']:.3f} | {hop['compute_ms']:.3f} "
                  f"| {hop['experts_ms']:.3f} | {hop['after_ms']:.3f} |")
        compute = sum(h["compute_ms"] for h in view["hops"])
        print(f"| {name} | wire | {view['wire_ms']:.3f} | | | |")
        if view.get("gateway_ms") is not None:
            print(f"| {name} | gateway between steps | {view['gateway_ms']:.3f} | | | |")
        print(f"| {name} | whole step ({view['steps']} traced) | | {view['total_ms']:.3f} "
              f"(compute {compute:.3f}) | | |")


def report_in_process(bundled: Path, args: argparse.Namespace) -> None:
    print("\n## Per-hop overhead (bundled model shapes, in process, median ms)\n")
    print("| part | ms |")
    print("|---|---|")
    for part, ms in per_hop(bundled, args.threads):
        print(f"| {part} | {ms:.3f} |")
    eff = wire_f16_effect(bundled, args.threads, args.tokens)
    print(f"\nf16 on the wire (3 windows, greedy {eff['tokens']} tokens): first divergence from "
          f"f32 at token {eff['first_divergence']} ({eff['tokens']} = none); max |logit delta| "
          f"before it {eff['max_abs_logit_delta']:.4f} (logits up to {eff['logit_scale']:.1f}); "
          "f32 on the wire is bit-exact")
    with tempfile.TemporaryDirectory() as tmp:
        moe = make_model(Path(tmp) / "moe.gguf", n_layer=4, n_expert=8, n_expert_used=2,
                         n_embd=128, n_head=8, n_head_kv=4, head_dim=128, n_ff_exp=768,
                         dtype="f32", tied_output=True)
        print("\nA MoE stage's decode steps, 4 sessions, experts answered 1 ms away (in "
              "process):")
        print("\n| 4 sessions | tokens/s |\n|---|---|")
        one, together = overlapped_sessions(moe, args.threads, 1.0)
        print(f"| one session at a time | {one:.1f} |")
        print(f"| interleaved (one computes while the others wait for experts) | "
              f"{together:.1f} ({together / one:.2f}x) |")


def overlapped_sessions(moe: Path, threads: int, away_ms: float, sessions: int = 4,
                        steps: int = 24) -> tuple[float, float]:
    """Decode tokens/s of `sessions` sessions on one stage whose MoE layers' experts are
    answered `away_ms` later (real expert compute, then a network's delay): stepping the
    sessions one after another (as a stage did before its steps could interleave) and all
    at once. In process, so it shows what overlapping buys when the workers are on other
    machines, without this machine's contention."""
    worker = Served.build([moe], Holdings(experts=tuple((lay, 0, 8) for lay in range(4))),
                          threads=threads, kv_slots=256, remote=lambda *a: None)  # type: ignore[arg-type,return-value]

    def hook(layer: int, first: int, end: int) -> ExpertShard:
        w = worker.run_of(layer, 0).worker  # type: ignore[union-attr]

        async def acall(lay: int, rows: np.ndarray, sel: np.ndarray) -> np.ndarray:
            out = w(lay, rows, sel + first)
            await trio.sleep(away_ms / 1000)
            return out

        return ExpertShard(first, end, lambda *a: trio.from_thread.run(acall, *a), acall)

    stage = Served.build([moe], Holdings(head=True, windows=((0, 4),)), threads=threads,
                         kv_slots=4096, remote=hook)
    server = StageServer(lambda: "m", lambda: stage, max_sessions=sessions, idle_s=60,
                         wire_dtype="f32")

    async def run(together: bool) -> float:
        for i in range(sessions):
            await server.handle("g", {"op": "close", "sid": str(i)})
            await server.handle("g", {"op": "open", "sid": str(i), "model": "m", "first": 0,
                                      "end": 4, "embed": True, "head": True,
                                      "max_tokens": steps + 8, "logprobs": 0, "sampling": {
                                          "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                                          "repetition_penalty": 1.0, "seed": 1}})

        async def decode(i: int) -> None:
            for t in range(steps):
                await server.handle("g", {"op": "step", "sid": str(i), "start": t, "ids": [1],
                                          "x": tensors.encode(np.asarray([1]), "i32")})

        began = time.perf_counter()
        if together:
            async with trio.open_nursery() as nursery:
                for i in range(sessions):
                    nursery.start_soon(decode, i)
        else:
            for i in range(sessions):
                await decode(i)
        return sessions * steps / (time.perf_counter() - began)

    try:
        trio.run(run, True)  # warm: graphs built
        one, together = [], []
        for _ in range(3):
            one.append(trio.run(run, False))
            together.append(trio.run(run, True))
        return statistics.median(one), statistics.median(together)
    finally:
        stage.close()
        worker.close()


async def _close_peers(host: Any) -> None:
    for pid in list(host.get_network().connections):
        await host.get_network().close_peer(pid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per generation")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per daemon")
    ap.add_argument("--rounds", type=int, default=7,
                    help="decode runs per layout, each followed by one of llama.cpp's")
    ap.add_argument("--sessions", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--in-process", action="store_true",
                    help="only the per-hop breakdown and the f16 effect (no daemons)")
    ap.add_argument("--only", nargs="*", default=[],
                    help="run only these layouts (e.g. '1 node' '3-stage ring')")
    args = ap.parse_args()
    configure("warning", json=False)  # the in-process parts' own logs stay out of the table
    bundled = bundled_path()
    if args.in_process:
        report_in_process(bundled, args)
        return
    rates: dict[str, float] = {}
    ratios: dict[str, float] = {}
    gaps: dict[str, str] = {}
    theirs: dict[Path, list[float]] = {}
    refs: dict[Path, LlamaCppDecoder | None] = {}
    conc: dict[str, dict[int, tuple[float, float]]] = {}
    batching: dict[str, str] = {}
    breakdowns: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        moe = make_model(root / "moe.gguf", n_layer=4, n_expert=8, n_expert_used=2, n_embd=128,
                         n_head=8, n_head_kv=4, head_dim=128, n_ff_exp=768, dtype="f32",
                         tied_output=True)
        moe_ring = [["head", "layers:0-2"], ["layers:2-4"], experts(0, 4), experts(4, 8)]
        hot = {"inference.hot_experts": 8, "inference.hot_after": 4}
        layouts: list[tuple[str, Path, list[list[str]], list[int], dict[str, Any]]] = [
            ("1 node", bundled, [["head", "layers:0-30"]], [], {}),
            ("3-stage ring", bundled, [["head", "layers:0-10"], ["layers:10-20"],
                                       ["layers:20-30"]], [], {}),
            ("MoE 1 node", moe, [["head", "layers:0-4", *experts(0, 8)]], [], {}),
            ("MoE ring + remote experts", moe, moe_ring, [2, 3], {}),
            ("MoE ring + remote experts, hot cache 8", moe, moe_ring, [2, 3], hot),
        ]
        for i, (name, model, placement, workers, extra) in enumerate(layouts):
            if args.only and name not in args.only:
                continue
            with start(root / f"net{i}", model, placement, args.threads, extra) as net:
                if model not in refs:
                    refs[model] = LlamaCppDecoder.start(args.threads, PROMPT, model)
                ours, ref_rates, token_gaps = decode_rates(net.nodes[0], args.tokens,
                                                           args.rounds, refs[model])
                rates[name] = statistics.median(ours)
                q = statistics.quantiles(token_gaps, n=10)
                gaps[name] = f"{q[0] * 1000:.1f} / {q[-1] * 1000:.1f}"
                if ref_rates:
                    theirs.setdefault(model, []).extend(ref_rates)
                    ratios[name] = statistics.median(o / r for o, r in zip(ours, ref_rates,
                                                                           strict=True))
                names = {n.peer_id: f"node{n.index}" for n in net.nodes}
                breakdowns[name] = (net.nodes[0].get("/v0/inference")["breakdown"], names)
                if name in ("3-stage ring", "MoE ring + remote experts"):
                    conc[name] = concurrency(net, args.sessions, args.tokens // 2)
                if workers:
                    batching[name] = expert_batching(net, workers)
            print(f"{name}: {rates[name]:.1f} tok/s", flush=True)
    for ref in refs.values():
        if ref is not None:
            ref.close()
    print(f"\n## Decode tokens/s (greedy, {args.tokens} tokens, {args.threads} thread(s) "
          f"per daemon, through the admin API's token stream; medians of {args.rounds} runs, "
          "each followed by a llama.cpp run: 'vs llama.cpp' is the median of those pairs' "
          "ratios)\n")
    print("| layout | tok/s | vs 1 node | vs llama.cpp | token gaps p10 / p90 ms |")
    print("|---|---|---|---|---|")
    for name, rate in rates.items():
        base = rates.get("1 node" if not name.startswith("MoE") else "MoE 1 node")
        vs = f"{ratios[name]:.2f}x" if name in ratios else "n/a"
        print(f"| {name} | {rate:.1f} | {f'{rate / base:.2f}x' if base else 'n/a'} | {vs} "
              f"| {gaps[name]} |")
    for model, label in ((bundled, "llama.cpp monolithic"), (moe, "llama.cpp monolithic, MoE")):
        if model in theirs:
            print(f"| {label} | {statistics.median(theirs[model]):.1f} | | 1.00x | |")
    if not theirs:
        print("\nllama.cpp: not built (native/llamacpp builds it into .cache/llamacpp-venv)")
    if "3-stage ring" in rates and "1 node" in rates:
        ring, one = 1000 / rates["3-stage ring"], 1000 / rates["1 node"]
        print(f"\nper token: 1 node {one:.2f} ms, ring {ring:.2f} ms: "
              f"the ring adds {ring - one:.2f} ms for 2 remote hops")
    report_breakdowns(breakdowns)
    if not args.only:
        report_in_process(bundled, args)
    if not conc:
        return
    print("\n## Aggregate tokens/s with concurrent sessions\n")
    print("| layout | " + " | ".join(f"{s} sessions" for s in args.sessions) + " |")
    print("|---|" + "---|" * len(args.sessions))
    for name, by in conc.items():
        print(f"| {name} | " + " | ".join(f"{by[s][0]:.1f}" for s in args.sessions) + " |")
    for name, by in conc.items():
        if any(rows for _, rows in by.values()):
            print(f"\nrows per expert message the stages sent ({name}): "
                  + ", ".join(f"{s} sessions {by[s][1]:.2f}" for s in args.sessions))
    for name, text in batching.items():
        print(f"\nexpert batching on the workers ({name}, whole run): {text}")


if __name__ == "__main__":
    main()

"""What one ring link costs on this machine, with our stack and without it.

Three processes pass a step round a ring, as the 3-stage ring does: each hop "computes"
for --compute-ms (streaming 32 MiB through the CPU's caches, as a stage's graph streams
its weights), then hands a 576-float row (the bundled model's hidden state) to the next.
Process 0 times rounds; a link's cost is (round - 3 x compute) / 3. Transports, side by
side in one run:

    blocking socket   plain TCP, length + msgpack frames, recv() blocking: the machine's
                      floor for a Python process (scheduler wake-up, loopback, syscalls)
    trio socket       the same frames on trio streams: what the event loop adds
    lane              our hot path: Channel.notify over a SealedStream (ChaCha20-Poly1305
                      records), channel.serve's reader and per-request task, the handler

    .venv/bin/python bench/bench_link.py [--rounds 400] [--compute-ms 2.2]

With --compute-ms 0 the hops never sleep long; with a stage's compute the receiving
process has been idle for two hops and finds its caches cold, which is what a ring's link
pays: the difference between the two rows is the machine's, not the transport's.
The last column is the lane's share between a frame being read and its handler running
(the task channel.serve starts per request), measured in hop 1.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import trio  # noqa: E402

from kvasird.inference.protocol import tensors  # noqa: E402
from kvasird.inference.transport.channel import serve  # noqa: E402
from kvasird.inference.transport.lane import SealedStream  # noqa: E402
from kvasird.logs import configure  # noqa: E402
from kvasird.wire.rpc import MAX_FRAME, Channel  # noqa: E402

HOPS = 3
KEY = bytes(range(32))
_LEN = struct.Struct(">I")


_BIG: np.ndarray | None = None


def spin(ms: float) -> None:
    """Hold the CPU for `ms`, streaming memory through its caches as a graph's weights do."""
    global _BIG
    if _BIG is None:
        _BIG = np.ones(8 << 20, np.float32)  # 32 MiB, more than any cache here
    end = time.perf_counter() + ms / 1000
    at = 0
    while time.perf_counter() < end:
        _BIG[at:at + (1 << 18)].sum()
        at = (at + (1 << 18)) % len(_BIG)


def payload() -> dict[str, Any]:
    x = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32)
    return {"op": "step", "sid": "s.1", "start": 10, "x": tensors.encode(x, "f32")}


# -- blocking sockets ------------------------------------------------------------------

def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _blocking(index: int, ports: list[int], ready: Any, go: Any, out: Any, rounds: int,
              compute_ms: float) -> None:
    listener = socket.create_server(("127.0.0.1", ports[index]))
    ready.wait()
    nxt = socket.create_connection(("127.0.0.1", ports[(index + 1) % HOPS]))
    nxt.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    prev, _ = listener.accept()
    go.wait()

    def send(msg: dict[str, Any]) -> None:
        body = msgpack.packb(msg)
        nxt.sendall(_LEN.pack(len(body)) + body)

    def receive() -> dict[str, Any]:
        (n,) = _LEN.unpack(_recv_exact(prev, 4))
        return msgpack.unpackb(_recv_exact(prev, n))

    times = []
    for _ in range(rounds):
        if index == 0:
            t = time.perf_counter()
            spin(compute_ms)
            send(payload())
            receive()
            times.append(time.perf_counter() - t)
        else:
            msg = receive()
            spin(compute_ms)
            send(msg)
    if index == 0:
        out.put(("times", times))


# -- trio sockets ----------------------------------------------------------------------

class _Plain:
    """A trio stream with the read/write a FrameReader and write_frame use."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream

    async def read(self, n: int | None = None) -> bytes:
        return await self.stream.receive_some(n or 65536)

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)


async def _trio_main(index: int, ports: list[int], ready: Any, go: Any, out: Any, rounds: int,
                     compute_ms: float, ours: bool) -> None:
    from kvasird.wire import FrameReader, write_frame

    accepted: list[trio.SocketStream] = []
    got = trio.Event()

    async def accept(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        got.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(ports[index], host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, accept, listeners)
        await trio.to_thread.run_sync(ready.wait)
        nxt_raw = await trio.open_tcp_stream("127.0.0.1", ports[(index + 1) % HOPS])
        await got.wait()
        prev_raw = accepted[0]
        await trio.to_thread.run_sync(go.wait)
        times: list[float] = []
        done = trio.Event()
        if ours:
            nxt: Any = SealedStream(nxt_raw, KEY, initiator=True, max_record=MAX_FRAME)
            prev: Any = SealedStream(prev_raw, KEY, initiator=False, max_record=MAX_FRAME)
            channel = Channel("next", nxt)
            seen = [0]
            began = [0.0]

            queued: list[float] = []

            async def handle(peer: str, msg: dict[str, Any]) -> dict[str, Any]:
                if index == 1:  # how long the frame waited between being read and handled
                    queued.append(time.monotonic() - msg["rx"])
                    if len(queued) == rounds:
                        out.put(("queued", queued))
                if index == 0:
                    times.append(time.perf_counter() - began[0])
                    seen[0] += 1
                    if seen[0] == rounds:
                        done.set()
                        return {}
                    began[0] = time.perf_counter()
                spin(compute_ms)
                await channel.notify({**msg, "id": 0}, 5.0)
                return {}

            nursery.start_soon(lambda: serve(prev, handle, 60.0, peer="prev"))
            if index == 0:
                began[0] = time.perf_counter()
                spin(compute_ms)
                await channel.notify({**payload(), "trace": []}, 5.0)
                await done.wait()
                out.put(("times", times))
            else:
                await trio.sleep(600)
        else:
            reader = FrameReader(_Plain(prev_raw), MAX_FRAME)
            nxt_plain = _Plain(nxt_raw)
            for _ in range(rounds):
                if index == 0:
                    t = time.perf_counter()
                    spin(compute_ms)
                    await write_frame(nxt_plain, payload(), MAX_FRAME)
                    await reader.read()
                    times.append(time.perf_counter() - t)
                else:
                    msg = await reader.read()
                    spin(compute_ms)
                    await write_frame(nxt_plain, msg, MAX_FRAME)
            if index == 0:
                out.put(("times", times))
        nursery.cancel_scope.cancel()


def _trio(index: int, ports: list[int], ready: Any, go: Any, out: Any, rounds: int,
          compute_ms: float, ours: bool) -> None:
    configure("warning", json=False)  # a lane ending when the bench stops is not news
    trio.run(_trio_main, index, ports, ready, go, out, rounds, compute_ms, ours)


def run(kind: str, rounds: int, compute_ms: float) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    ports = []
    for _ in range(HOPS):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    ready, go, out = ctx.Barrier(HOPS), ctx.Barrier(HOPS), ctx.Queue()
    if kind == "blocking socket":
        target, extra = _blocking, ()
    else:
        target, extra = _trio, (kind == "lane",)
    procs = [ctx.Process(target=target, args=(i, ports, ready, go, out, rounds, compute_ms,
                                              *extra), daemon=True) for i in range(HOPS)]
    for p in procs:
        p.start()
    got: dict[str, list[float]] = {}
    try:
        while len(got) < (2 if kind == "lane" else 1):
            name, values = out.get(timeout=120)
            got[name] = values[rounds // 10:]
    finally:
        for p in procs:
            p.kill()
            p.join()
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--compute-ms", type=float, nargs="+", default=[0.0, 2.2])
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each transport, alternating (medians of medians)")
    args = parser.parse_args()
    kinds = ["blocking socket", "trio socket", "lane"]
    print(f"# one ring link, {HOPS} processes, 2.3 KB steps, {args.rounds} rounds x "
          f"{args.repeat} runs each (median of run medians; ms per link)\n")
    columns = [*kinds, "of which lane: frame read -> handler"]
    print("| compute per hop (ms) | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for compute_ms in args.compute_ms:
        per: dict[str, list[float]] = {k: [] for k in columns}
        for _ in range(args.repeat):
            for kind in kinds:
                got = run(kind, args.rounds, compute_ms)
                per[kind].append((statistics.median(got["times"]) * 1000 - HOPS * compute_ms)
                                 / HOPS)
                if "queued" in got:
                    per[columns[-1]].append(statistics.median(got["queued"]) * 1000)
        print(f"| {compute_ms:g} | " + " | ".join(f"{statistics.median(per[k]):.3f}"
                                                 for k in columns) + " |")


if __name__ == "__main__":
    main()

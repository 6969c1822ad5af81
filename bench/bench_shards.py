"""Shard transfer throughput vs the raw libp2p stream it runs on vs a plain file copy.

    .venv/bin/python bench/bench_shards.py [--model PATH] [--raw-mib 64] [--profile]
                                           [--processes] [--repeat N]

Two hosts in one process, built by the daemon's own ``build_host`` (TCP + Noise +
yamux on 127.0.0.1); with ``--processes`` the libp2p rows are repeated against a
holder in a second process, as peers really are (each side gets its own GIL). Rows:

    file copy                 shutil.copyfile of the model (page cache warm): the disk ceiling
    shard download, memory    the shard protocol over trio in-memory streams: our own cost
                              (framing, sha256, store writes) without any network stack
    raw libp2p stream         one stream over TCP + Noise + yamux; the server writes
                              --raw-mib MiB in 1 MiB writes
    shard download            the whole model (every unit) from host B's store into a fresh
                              store over libp2p; "2 streams": two streams to the one holder
    [batched updates]         the same with PY_YAMUX_RELEASE_ON_READ=0: py-libp2p's yamux batches
                              receive-window updates instead of sending one per read

``--profile`` prints where the CPU goes during the raw libp2p stream (cProfile, by own time).
Design target (DESIGN.md): >= 100 MB/s.
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import os
import pstats
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import multiaddr
import trio
from libp2p.peer.id import ID
from trio.testing import memory_stream_pair

from kvasird.identity.nodekey import create_node_key
from kvasird.logs import configure
from kvasird.model import bundled
from kvasird.model.store import ShardStore
from kvasird.model.transfer import download, serve_shards
from kvasird.wire.protocols import SHARD_PROTOCOL
from kvasird.p2p.host import build_host, parse_listen

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvasird_dev (not installed)
from kvasird_dev.testmodels import make_model  # noqa: E402

RAW_PROTOCOL = "/kvasir/bench-raw/1"
YAMUX_POLICIES = (("", "1"), (" [batched updates]", "0"))
"""py-libp2p's default sends a WINDOW_UPDATE per read; PY_YAMUX_RELEASE_ON_READ=0 batches."""
MiB = 1 << 20


def model_path(arg: str | None, tmp: Path) -> Path:
    if arg:
        return Path(arg)
    try:
        return bundled.bundled_path(fetch=False)
    except bundled.BundledModelError:
        print("bundled model not fetched; using a generated 30 MB qwen3moe", file=sys.stderr)
        return make_model(tmp / "moe.gguf", "qwen3moe", n_layer=4, n_embd=256, n_head=4,
                          head_dim=64, n_ff_exp=256, dtype="q4_k")


def file_copy(path: Path, tmp: Path) -> tuple[int, float]:
    path.read_bytes()  # warm the page cache, as the store's blobs are when serving
    t = time.perf_counter()
    shutil.copyfile(path, tmp / "copy.gguf")
    return path.stat().st_size, time.perf_counter() - t


class TrioStream:
    """A trio stream with the read/write/close of a libp2p stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._s = stream

    async def read(self, n: int | None = None) -> bytes:
        return await self._s.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self._s.send_all(data)

    async def close(self) -> None:
        await self._s.aclose()


async def shard_memory(source: ShardStore, model_id: str, tmp: Path) -> tuple[int, float]:
    client = ShardStore(tmp / "mem" / "shards", tmp / "mem.db")
    async with trio.open_nursery() as nursery:
        async def open_stream(_peer: object) -> TrioStream:
            a, b = memory_stream_pair()
            nursery.start_soon(serve_shards, TrioStream(b), source)
            return TrioStream(a)

        t = time.perf_counter()
        report = await download(client, model_id, None, ["mem"], open_stream)
        elapsed = time.perf_counter() - t
        nursery.cancel_scope.cancel()
    client.close()
    return report.received_bytes, elapsed


async def _send_zeros(stream) -> None:
    """Raw-stream server: on one byte from the client, write the asked-for MiB of zeros."""
    mib = (await stream.read(4))[0]
    block = bytes(MiB)
    for _ in range(mib):
        await stream.write(block)
    await stream.close()


def mount(host, source: ShardStore) -> None:
    host.set_stream_handler(RAW_PROTOCOL, _send_zeros)
    host.set_stream_handler(SHARD_PROTOCOL, lambda s: serve_shards(s, source))


async def raw_stream(a, peer, mib: int, profile: bool) -> tuple[int, float, pstats.Stats | None]:
    stream = await a.new_stream(peer, [RAW_PROTOCOL])
    prof = cProfile.Profile() if profile else None
    await stream.write(bytes([mib]))
    t = time.perf_counter()
    if prof:
        prof.enable()
    got = 0
    while got < mib * MiB:
        part = await stream.read(MiB)
        if not part:
            break
        got += len(part)
    elapsed = time.perf_counter() - t
    if prof:
        prof.disable()
    await stream.close()
    return got, elapsed, pstats.Stats(prof) if prof else None


async def shard_libp2p(a, peer, model_id: str, tmp: Path, name: str,
                       streams: int) -> tuple[int, float]:
    client = ShardStore(tmp / name / "shards", tmp / f"{name}.db")

    async def open_stream(_slot: int):
        return await a.new_stream(peer, [SHARD_PROTOCOL])

    t = time.perf_counter()
    report = await download(client, model_id, None, list(range(streams)), open_stream)
    elapsed = time.perf_counter() - t
    client.close()
    return report.received_bytes, elapsed


def new_host(tmp: Path, name: str):
    listen = parse_listen(("/ip4/127.0.0.1/tcp/0",))
    host = build_host(create_node_key(tmp / f"{name}.key"), listen, [], 8)
    return host, [multiaddr.Multiaddr(x) for x in listen]


async def close_all(host) -> None:
    for pid in list(host.get_network().connections):
        await host.get_network().close_peer(pid)


async def over_libp2p(a, peer, model_id: str, tmp: Path, args: argparse.Namespace,
                      where: str) -> tuple[list[tuple[str, int, float]], pstats.Stats | None]:
    """The libp2p rows, once per yamux window-update policy of the receiving side."""
    rows, stats = [], None
    for policy, release_on_read in YAMUX_POLICIES:
        os.environ["PY_YAMUX_RELEASE_ON_READ"] = release_on_read
        n, secs, prof = await raw_stream(a, peer, args.raw_mib, args.profile and stats is None)
        stats = stats or prof
        rows.append((f"raw libp2p stream{where}{policy}", n, secs))
        for k in (1, 2):
            label = f"shard download{where}{policy}" + (f", {k} streams" if k > 1 else "")
            name = f"c{k}{where}{release_on_read}".replace(" ", "").replace(",", "")
            rows.append((label, *await shard_libp2p(a, peer, model_id, tmp, name, k)))
    return rows, stats


def serve_in_child(tmp: Path, conn: Connection) -> None:
    """Host B in its own process (its own GIL), serving the source store until told to stop."""
    async def run() -> None:
        configure("warning", json=False)
        b, listen = new_host(tmp, "child")
        with ShardStore(tmp / "src" / "shards", tmp / "src.db") as source:
            mount(b, source)
            async with b.run(listen):
                conn.send((b.get_id().to_base58(), [str(x) for x in b.get_addrs()]))
                await trio.to_thread.run_sync(conn.recv)
                await close_all(b)

    trio.run(run)


async def main(args: argparse.Namespace) -> None:
    configure("warning", json=False)
    best: dict[str, tuple[int, float]] = {}
    stats = None
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        path = model_path(args.model, tmp)
        for run in range(args.repeat):
            (tmp / f"run{run}").mkdir()
            rows, run_stats = await one_run(args, path, tmp / f"run{run}")
            stats = stats or run_stats
            for label, n, secs in rows:
                if label not in best or secs < best[label][1]:
                    best[label] = (n, secs)
    print(f"\nmodel: {path.name}; best of {args.repeat} run(s)\n")
    width = max(len(label) for label in best)
    print(f"| {'path':{width}} | {'MB':>8} | {'seconds':>8} | {'MB/s':>8} |")
    print(f"|{'-' * (width + 2)}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    for label, (n, secs) in best.items():
        print(f"| {label:{width}} | {n / 1e6:8.1f} | {secs:8.3f} | {n / 1e6 / secs:8.1f} |")
    if stats is not None:
        print("\nraw libp2p stream, receiving side and the host's tasks, by own time:")
        stats.sort_stats("tottime").print_stats(18)


async def one_run(args: argparse.Namespace, path: Path,
                  tmp: Path) -> tuple[list[tuple[str, int, float]], pstats.Stats | None]:
    source = ShardStore(tmp / "src" / "shards", tmp / "src.db")
    model_id = source.import_gguf(path).model_id
    rows = [("file copy", *file_copy(path, tmp))]
    rows.append(("shard download, memory streams", *await shard_memory(source, model_id, tmp)))
    a, a_listen = new_host(tmp, "a")
    b, b_listen = new_host(tmp, "b")
    mount(b, source)
    async with a.run(a_listen), b.run(b_listen):
        a.get_peerstore().add_addrs(b.get_id(), b.get_addrs(), 3600)
        await a.connect(a.get_peerstore().peer_info(b.get_id()))
        more, stats = await over_libp2p(a, b.get_id(), model_id, tmp, args, "")
        rows += more
        await close_all(b)
        if args.processes:
            rows += await against_child(a, model_id, tmp, args)
        await close_all(a)
    source.close()
    return rows, stats


async def against_child(a, model_id: str, tmp: Path,
                        args: argparse.Namespace) -> list[tuple[str, int, float]]:
    parent, child = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(target=serve_in_child, args=(tmp, child))
    proc.start()
    try:
        pid, addrs = await trio.to_thread.run_sync(parent.recv)
        peer = ID.from_base58(pid)
        a.get_peerstore().add_addrs(peer, [multiaddr.Multiaddr(x) for x in addrs], 3600)
        await a.connect(a.get_peerstore().peer_info(peer))
        rows, _ = await over_libp2p(a, peer, model_id, tmp, args, ", 2 processes")
        return rows
    finally:
        parent.send("stop")
        await trio.to_thread.run_sync(proc.join, 10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF to transfer (default: the bundled SmolLM2)")
    parser.add_argument("--raw-mib", type=int, default=64, help="MiB for the raw stream rows")
    parser.add_argument("--profile", action="store_true", help="profile the raw stream row")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs; each row reports its best (the machine may be shared)")
    parser.add_argument("--processes", action="store_true",
                        help="also measure against a holder in a second process")
    trio.run(main, parser.parse_args())

"""A foreign py-libp2p peer that sends a node everything it should survive, for a while.

For every stream protocol a node serves, and for its lane port, it opens streams and
writes, at random: garbage, a frame claiming 2 GB, a frame cut short, a frame that is
not msgpack, msgpack of the wrong shape, a stream closed at once, and a frame dribbled
a byte at a time (slow). On every gossip topic it publishes garbage and oversized
messages, and on the gossip protocol itself raw RPCs that do not parse. With
``answer_liveness=False`` it never answers the node's heartbeat, so the node drops it
every liveness timeout (possibly while an RPC of its is half read) and it dials again.

    counts = await FuzzPeer(network).run(join_addr, peer_id, lane_port, seconds=60)

Used by tests/integration/test_foreign_peer.py and bench/fuzz_peer.py; every count is
(protocol or topic, kind) -> messages sent.
"""

from __future__ import annotations

import contextlib
import os
import random
import struct
from collections import Counter

import httpx
import multiaddr
import trio
import trio.lowlevel
from gossip_peer import GossipPeer  # type: ignore[import-not-found]
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.utils import encode_varint_prefixed

from kvasird.localnet import LocalNet, LocalNode
from kvasird.localnet.placement import pinned
from kvasird.model.bundled import bundled_path
from kvasird.wire import pack

STREAM_PROTOCOLS = ("/kvasir/heartbeat/1", "/kvasir/px/1", "/kvasir/dialback/1",
                    "/kvasir/addrs/1", "/kvasir/stage/1", "/kvasir/experts/1",
                    "/kvasir/shard/1", "/kvasir/settle/1", "/kvasir/coverage-sync/1",
                    "/kvasir/goodbye/1")
TOPICS = ("coverage", "load", "governance", "unfit")
KINDS = ("garbage", "oversized", "truncated", "not-msgpack", "wrong-shape", "half-closed",
         "slow")
WRONG_SHAPES = (
    {"op": "open", "sid": 5, "model": None, "first": -1, "end": 2**40},
    {"op": "step", "sid": "x", "start": "0", "x": {"dt": "f32", "shape": [10**9, 10**9],
                                                  "data": b""}},
    {"op": "experts", "layer": 10**6, "rows": [], "ids": "nope"},
    {"t": "hello", "network": "x" * 10_000, "protocol": -1},
    {"op": "claim", "receipt": {"amount": -5}},
    [1, 2, 3], "a string", 12345, None,
)


def start_target(net: LocalNet) -> LocalNode:
    """Node 0 of a two-node `net` holds the whole bundled model (the node to fuzz), node 1
    nothing (its honest peer); node 0 once it serves generations."""
    previous = ""
    for node, pins in zip(net.nodes, [["head", "layers:0-30"], []], strict=True):
        node.settings = pinned(bundled_path(), pins) if pins else {}
        previous = net.configure(node, [previous] if previous else [])
    for node in net.nodes:
        node.start()
    net.wait_until("the node serves", lambda: generate_ok(net.nodes[0]), timeout=120)
    return net.nodes[0]


def generate_ok(node: LocalNode) -> bool:
    """Whether a 4-token greedy generation through `node`'s admin API succeeds."""
    body = {"prompt": [1, 504, 3458], "max_tokens": 4, "temperature": 0}
    url = node.home.admin_address()
    if url is None:
        return False
    try:
        resp = httpx.post(url + "/v0/generate", json=body, timeout=30)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and '"error"' not in resp.text


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def payload(kind: str, rng: random.Random) -> bytes:
    if kind == "garbage":
        return os.urandom(rng.randint(1, 4096))
    if kind == "oversized":
        return struct.pack(">I", 0x7FFF_FFFF) + os.urandom(1024)
    if kind == "truncated":
        return struct.pack(">I", 1000) + os.urandom(10)
    if kind == "not-msgpack":
        return _frame(b"\xc1" + os.urandom(rng.randint(0, 64)))
    if kind == "wrong-shape":
        return _frame(pack(rng.choice(WRONG_SHAPES)))
    return b""


class FuzzPeer(GossipPeer):
    def __init__(self, network: str, *, answer_liveness: bool = True, seed: int = 0) -> None:
        super().__init__(network)
        self.answer_liveness = answer_liveness
        self.rng = random.Random(seed)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.redials = 0

    async def _heartbeat(self, stream) -> None:  # noqa: ANN001
        if self.answer_liveness:
            await super()._heartbeat(stream)
        else:
            await trio.sleep_forever()  # read nothing, answer nothing

    async def run(self, join: str, target: str, lane_port: int | None, seconds: float,
                  concurrency: int = 4) -> Counter[tuple[str, str]]:
        """Attack `target` (reached at `join`) for `seconds`; return what was sent."""
        async with self.running(join):
            with trio.move_on_after(seconds):
                async with trio.open_nursery() as nursery:
                    for _ in range(concurrency):
                        nursery.start_soon(self._streams, join, target)
                    nursery.start_soon(self._gossip)
                    if lane_port:
                        nursery.start_soon(self._lane, lane_port)
        return self.counts

    async def _streams(self, join: str, target: str) -> None:
        peer = ID.from_base58(target)
        while True:
            if peer not in self.host.get_network().connections:
                with trio.move_on_after(5):
                    try:
                        await self.host.connect(info_from_p2p_addr(multiaddr.Multiaddr(join)))
                        self.redials += 1
                    except Exception:  # noqa: BLE001 - the node may refuse us a while
                        await trio.sleep(0.5)
                        continue
            proto = self.rng.choice(STREAM_PROTOCOLS + ("/meshsub/1.1.0",))
            kind = self.rng.choice(KINDS)
            with trio.move_on_after(5):
                try:
                    stream = await self.host.new_stream(peer, [proto])
                except Exception:  # noqa: BLE001 - dropped, refused: try again
                    await trio.sleep(0.05)
                    continue
                self.counts[(proto, kind)] += 1
                try:
                    with contextlib.suppress(Exception):  # the node hung up on us, as it should
                        await self._send(stream, proto, kind)
                finally:
                    with trio.move_on_after(1), contextlib.suppress(Exception):
                        await stream.reset()
            await trio.lowlevel.checkpoint()

    async def _send(self, stream, proto: str, kind: str) -> None:  # noqa: ANN001
        if kind == "half-closed":
            await stream.close()
            return
        if proto == "/meshsub/1.1.0":
            body = os.urandom(self.rng.randint(1, 2048)) if kind != "oversized" else \
                b"\xff" * 200_000
            await stream.write(encode_varint_prefixed(body))
            return
        if kind == "slow":
            for byte in payload("wrong-shape", self.rng):
                await stream.write(bytes([byte]))
                await trio.sleep(0.2)
            return
        await stream.write(payload(kind, self.rng))
        with trio.move_on_after(0.5):
            await stream.read(65536)

    async def _gossip(self) -> None:
        while True:
            topic = self.rng.choice(TOPICS)
            kind = self.rng.choice(("garbage", "oversized", "wrong-shape"))
            data = (os.urandom(self.rng.randint(1, 2048)) if kind == "garbage" else
                    b"x" * 600_000 if kind == "oversized" else
                    pack(self.rng.choice(WRONG_SHAPES)))
            self.counts[(f"gossip:{topic}", kind)] += 1
            with contextlib.suppress(Exception):  # our own router may refuse an oversized one
                await self.publish(topic, data)
            await trio.sleep(0.05)

    async def _lane(self, port: int) -> None:
        while True:
            kind = self.rng.choice(KINDS)
            with trio.move_on_after(5):
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    await trio.sleep(0.2)
                    continue
                self.counts[("lane", kind)] += 1
                async with stream:
                    try:
                        if kind == "slow":
                            for byte in os.urandom(16):
                                await stream.send_all(bytes([byte]))
                                await trio.sleep(0.2)
                        elif kind != "half-closed":
                            await stream.send_all(payload(kind, self.rng) or b"\0")
                            with trio.move_on_after(0.5):
                                await stream.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            await trio.sleep(0.02)

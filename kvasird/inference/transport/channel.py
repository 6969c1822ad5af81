"""Inference's channels: rpc (kvasird.wire.rpc) to peers by (peer, protocol), with lanes.

A caller keeps one rpc Channel per (peer, protocol), opened on first use over libp2p (the
node's dialer reaching peers we hold no connection to). A peer that fails or stays silent
is dropped: every channel and lane to it is reset, and the next request opens a new one.

    Channels.request(peer, proto, msg) ──▶ rpc.Channel ──▶ peer's serve() (here: rpc.serve
    Channels.notify(peer, proto, msg)  ──▶                  with inference's hooks)

Once a libp2p channel is open, Channels asks the peer for a lane (lane.py: a direct TCP
connection keyed over the channel, faster per round trip: bench/bench_link.py) in the
background and
moves the peer's requests onto it when it is up; the libp2p channel stays the fallback.
serve() is rpc.serve with inference's two hooks: a LaneAsk answered with a ticket for a
lane to the protocol, and a traced step stamped with when it arrived (steptrace).

One-way messages carry the stage-to-stage forwarding of a generation's steps (swarm.py):
whatever they lead to comes back as another message, from another peer. To a far peer
(`twin`: a long round trip) a small one goes on both paths at once, its lane and its libp2p
stream (two TCP connections): a packet lost on one costs nothing while the other's copy
arrives, where one connection waits for a tail-loss probe or a retransmission timeout
(bench/bench_loss.py: at 20 ms and 1 % loss, a hop's p99 1.04x the lossless one against
7x). The receiver keeps the first copy (the stage server by the step's ticket, the Inbox
by its expectation). Prompt chunks, the bulk, go once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from kvasird.errors import WireError
from kvasird.inference.transport import lane
from kvasird.logs import get_logger
from kvasird.p2p.reachability import is_circuit
from kvasird.wire import rpc
from kvasird.wire.rpc import MAX_FRAME, Channel, Handler, HopFailed, Intake, Refused, Unreachable

OPEN_TIMEOUT_S = 5.0
TWIN_BYTES = 16 * 1024
"""One-way messages up to this size go on both paths to a far peer: decode steps and
results (a hidden row is 1-5 KiB), not prompt chunks."""
LANE_OPEN_S = 2.0
"""Longest a lane may take to come up (offer, TCP connect, confirmation)."""
log = get_logger("kvasird.inference.transport.channel")


class Channels:
    """The caller's open channels, by (peer, protocol); reader tasks live in its nursery.

    With `lanes` on, each (peer, protocol) also gets a lane when the peer offers one, and
    requests go over the lane while it is up.
    """

    def __init__(
        self,
        host: IHost,
        lanes: bool = True,
        connect: Callable[[str], Awaitable[bool]] | None = None,
        twin: Callable[[str], bool] | None = None,
    ) -> None:
        self.host = host
        self.lanes = lanes
        self.twin = twin
        """Whether a peer is far enough for small one-way messages to go on both paths."""
        self.twinned = 0
        """One-way messages sent on both paths, since start."""
        self.connect = connect
        """How to reach a peer we hold no connection to (the node's dialer: directly or
        through one of its relays); py-libp2p's own dial knows no circuit addresses."""
        self._open: dict[tuple[str, str], Channel] = {}
        self._lanes: dict[tuple[str, str], Channel] = {}
        self._lane_next: dict[tuple[str, str], float] = {}
        self._lane_fails: dict[tuple[str, str], int] = {}
        """Lane attempts in a row that did not come up, by (peer, protocol)."""
        self._opening: dict[tuple[str, str], trio.Lock] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def request(
        self, peer: str, protocol: str, msg: dict[str, Any], wait_s: float
    ) -> dict[str, Any]:
        channel = await self._get(peer, protocol)
        try:
            return await channel.request(msg, wait_s)
        except Refused:
            raise
        except HopFailed:
            self.drop(peer)
            raise

    async def notify(self, peer: str, protocol: str, msg: dict[str, Any], wait_s: float) -> None:
        """A one-way message to `peer` (HopFailed when it cannot be sent)."""
        channel = await self._get(peer, protocol)
        other = self._open.get((peer, protocol))
        if (
            self.twin is not None
            and other is not None
            and other is not channel
            and not other.closed
            and self.twin(peer)
            and len(data := rpc.notification(msg)) <= TWIN_BYTES
        ):
            await self._twice(peer, (channel, other), data, wait_s)
            return
        try:
            await channel.notify(msg, wait_s)
        except HopFailed:
            self.drop(peer)
            raise

    async def _twice(
        self, peer: str, paths: tuple[Channel, Channel], data: bytes, wait_s: float
    ) -> None:
        """`data` on both paths at once; HopFailed only when neither took it."""
        failed: list[HopFailed] = []

        async def send(channel: Channel) -> None:
            try:
                await channel.notify_frame(data, wait_s)
            except HopFailed as exc:
                channel.fail()
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            for channel in paths:
                nursery.start_soon(send, channel)
        self.twinned += 1
        if len(failed) == len(paths):
            self.drop(peer)
            raise failed[0]

    def lanes_up(self) -> list[tuple[str, str]]:
        """(peer, protocol) pairs whose requests go over a lane now."""
        return [k for k, c in self._lanes.items() if not c.closed]

    def on_libp2p(self) -> list[tuple[str, str]]:
        """(peer, protocol) pairs whose requests still go over libp2p (no lane up)."""
        return [k for k, c in self._open.items() if not c.closed and not self.lane_open(*k)]

    def lane_open(self, peer: str, protocol: str) -> bool:
        """Whether requests to `peer` on `protocol` go over a lane now."""
        lane_channel = self._lanes.get((peer, protocol))
        return lane_channel is not None and not lane_channel.closed

    async def _get(self, peer: str, protocol: str) -> Channel:
        key = (peer, protocol)
        lane_channel = self._lanes.get(key)
        if lane_channel is not None and not lane_channel.closed:
            return lane_channel
        channel = await self._get_stream(peer, protocol)
        now = trio.current_time()
        if self.lanes and self._nursery is not None and self._lane_next.get(key, 0) <= now:
            first, most = lane.LANE_RETRY_S
            fails = self._lane_fails.get(key, 0)
            self._lane_next[key] = now + min(most, first * 2 ** min(fails, 16))
            self._lane_fails[key] = fails + 1  # until the lane is up
            self._nursery.start_soon(self._open_lane, key, channel)
        return channel

    async def _open_lane(self, key: tuple[str, str], channel: Channel) -> None:
        peer = key[0]
        try:
            offer = lane.LaneOffer.from_wire(
                await channel.request(lane.LaneAsk().to_wire(), LANE_OPEN_S)
            )
            ips = self._lane_ips(peer, channel)
            if not ips:
                raise WireError("no direct address of the peer is known (relayed)")
            sealed, tried = None, []
            with trio.move_on_after(LANE_OPEN_S):
                for ip in ips:  # the ticket is spent only where the connect succeeds
                    try:
                        sealed = await lane.connect(ip, offer, MAX_FRAME, LANE_OPEN_S)
                        break
                    except Exception as exc:  # noqa: BLE001 - try the next address
                        tried.append(f"{ip}: {exc!r}")
            if sealed is None:
                raise WireError(f"no lane server answered at {'; '.join(tried) or ips}")
        except Exception as exc:  # noqa: BLE001 - lanes are optional: any failure keeps libp2p
            log.info("no lane: staying on libp2p", peer=peer, protocol=key[1], reason=repr(exc))
            return
        lane_channel = Channel(peer, sealed)
        assert self._nursery is not None
        self._nursery.start_soon(lane_channel.read_replies)
        self._lanes[key] = lane_channel
        self._lane_fails.pop(key, None)
        self._lane_next[key] = trio.current_time() + 5.0  # a lane that breaks may be renewed soon
        log.debug("lane open", peer=peer, protocol=key[1], address=ip)

    def _lane_ips(self, peer: str, channel: Channel) -> list[str]:
        """Where the peer's lane server may be: the IP of our connection to it; else the
        IPs of the direct addresses we know of it. py-libp2p reports no address for a
        WebSocket connection (nor a relayed one): two local nodes that happened to connect
        over WebSocket at start-up never got a lane, and their hops stayed 4x slower."""
        stream = channel.stream  # a libp2p stream: a lane's channel is never asked
        remote = stream.get_remote_address() if isinstance(stream, INetStream) else None
        if remote:
            return [remote[0]]
        try:
            addrs = [str(a) for a in self.host.get_peerstore().addrs(ID.from_base58(peer))]
        except Exception:  # noqa: BLE001 - a peer we hold no addresses of
            return []
        return list(
            dict.fromkeys(ip for a in addrs if not is_circuit(a) and (ip := lane.tcp_ip(a)))
        )

    async def _get_stream(self, peer: str, protocol: str) -> Channel:
        key = (peer, protocol)
        async with self._opening.setdefault(key, trio.Lock()):
            channel = self._open.get(key)
            if channel is not None and not channel.closed:
                return channel
            try:
                with trio.fail_after(OPEN_TIMEOUT_S):
                    stream = await self._new_stream(ID.from_base58(peer), protocol)
            except trio.TooSlowError:
                raise Unreachable(
                    peer, f"no {protocol} stream within {OPEN_TIMEOUT_S:g} s"
                ) from None
            except Exception as exc:  # noqa: BLE001 - unreachable peers raise many types
                raise Unreachable(peer, f"cannot open {protocol}: {exc!r}") from None
            channel = Channel(peer, stream)
            assert self._nursery is not None, "Channels.run must be started first"
            self._nursery.start_soon(channel.read_replies)
            self._open[key] = channel
            return channel

    async def _new_stream(self, pid: ID, protocol: str) -> INetStream:
        """A new stream, redialling once if the connection we have cannot carry one.

        py-libp2p sometimes keeps a connection whose muxer never finished its upgrade (two
        peers dialling each other at once, a busy machine): every stream on it fails. The
        stream is then tried once more on a fresh connection.
        """
        if self.connect is not None and not self.host.get_network().get_connections(pid):
            await self.connect(str(pid))
        try:
            return await self.host.new_stream(pid, [TProtocol(protocol)])
        except Exception as exc:  # noqa: BLE001 - unreachable peers raise many types
            if not self.host.get_network().get_connections(pid):
                raise
            log.debug(
                "stream failed on an existing connection: redialling",
                peer=str(pid),
                reason=repr(exc)[:200],
            )
            await self.host.get_network().close_peer(pid)
            return await self.host.new_stream(pid, [TProtocol(protocol)])

    def drop(self, peer: str) -> None:
        """Forget (and reset) every channel and lane to `peer`: it failed or timed out."""
        for table in (self._open, self._lanes):
            for key in [k for k in table if k[0] == peer]:
                channel = table.pop(key)
                channel.fail()
                if self._nursery is not None:
                    self._nursery.start_soon(rpc.reset, channel.stream)


async def serve(
    stream: rpc.Stream,
    handle: Handler,
    idle_s: float,
    *,
    peer: str = "",
    lanes: lane.LaneServer | None = None,
    protocol: str = "",
    parse: Callable[[dict[str, Any]], Any] | None = None,
    inline: Callable[[Any], bool] | None = None,
    intake: Intake | None = None,
) -> None:
    """rpc.serve (see there) with inference's hooks: with `lanes`, a LaneAsk is answered
    with a LaneOffer, a ticket for a lane to this `protocol`; a traced step is stamped with
    when it arrived."""
    own = None if lanes is None else {lane.LaneAsk.TYPE: functools.partial(_offer, lanes, protocol)}
    await rpc.serve(
        stream,
        handle,
        idle_s,
        peer=peer,
        protocol=protocol,
        parse=parse,
        inline=inline,
        intake=intake,
        own=own,
        arrived=_stamp,
    )


async def _offer(lanes: lane.LaneServer, protocol: str, caller: str, _: Any) -> dict[str, Any]:
    return lanes.offer(caller, protocol).to_wire()


def _stamp(msg: dict[str, Any]) -> None:
    """A traced step: when it arrived (its sender cannot say)."""
    if "trace" in msg:
        msg["rx"] = time.monotonic()

"""Peer exchange: ask connected peers whom they know, and dial some of those.

This is how five nodes joined in a chain (each knowing only its predecessor) end up
all connected. One request and one reply per stream; both bounded in size and time.
"""

from __future__ import annotations

import random

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from kvasird.logs import get_logger
from kvasird.p2p.dialer import Dialer
from kvasird.p2p.messages import Peers, PeersAsk
from kvasird.p2p.peers import PeerTable
from kvasird.p2p.streams import served
from kvasird.wire import read_frame, write_frame
from kvasird.wire.protocols import PX_PROTOCOL

ASK_PER_ROUND = 3
TIMEOUT_S = 5.0
_MAX_FRAME = 256 * 1024
log = get_logger("kvasird.p2p.exchange")


class PeerExchange:
    def __init__(self, host: IHost, peers: PeerTable, dialer: Dialer, interval_s: float) -> None:
        self._host = host
        self._peers = peers
        self._dialer = dialer
        self._interval = interval_s

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._host.set_stream_handler(PX_PROTOCOL, self._serve)
        task_status.started()
        while True:
            await trio.sleep(self._interval * random.uniform(0.2, 0.6))
            await self.round()
            await trio.sleep(self._interval * random.uniform(0.4, 0.8))

    async def round(self) -> None:
        known = [p.peer_id for p in self._peers.snapshot()]
        for pid in random.sample(known, min(ASK_PER_ROUND, len(known))):
            try:
                learned = await self._ask(ID.from_base58(pid))
            except Exception as exc:  # noqa: BLE001 - a failing peer is the liveness service's business
                log.debug("peer exchange failed", peer=pid, error=repr(exc))
                continue
            async with trio.open_nursery() as nursery:
                for other, addrs in learned:
                    if (
                        other not in self._peers
                        and addrs
                        and self._dialer.room()
                        and self._dialer.due(other)
                    ):
                        nursery.start_soon(self._dialer.dial, list(addrs))

    async def _ask(self, pid: ID) -> tuple[tuple[str, tuple[str, ...]], ...]:
        with trio.fail_after(TIMEOUT_S):
            stream = await self._host.new_stream(pid, [PX_PROTOCOL])
            try:
                await write_frame(stream, PeersAsk().to_wire())
                return Peers.from_wire(await read_frame(stream, _MAX_FRAME)).peers
            finally:
                await stream.close()

    async def _serve(self, stream: INetStream) -> None:
        asker = stream.muxed_conn.peer_id.to_string()
        async with served(stream, "peer exchange", asker):
            with trio.fail_after(TIMEOUT_S):
                PeersAsk.from_wire(await read_frame(stream, 1024))
                peers = Peers(
                    tuple(
                        (p.peer_id, p.addrs)
                        for p in self._peers.snapshot()
                        if p.addrs and p.peer_id != asker
                    )
                )
                await write_frame(stream, peers.to_wire(), _MAX_FRAME)

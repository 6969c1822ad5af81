"""Peer exchange: ask connected peers whom they know, and dial some of those.

This is how five nodes joined in a chain (each knowing only its predecessor) end up
all connected. One request and one reply per stream; both bounded in size and time.
"""

from __future__ import annotations

import random
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from kvasird.logs import get_logger
from kvasird.p2p.dialer import Dialer
from kvasird.p2p.hello import MAX_ADDR_LEN, MAX_ADDRS
from kvasird.p2p.peers import PeerTable
from kvasird.p2p.streams import served
from kvasird.wire import read_frame, schema, write_frame

PROTOCOL = "/kvasir/px/1"
MAX_PEERS_PER_REPLY = 64
ASK_PER_ROUND = 3
TIMEOUT_S = 5.0
_MAX_FRAME = 256 * 1024
log = get_logger("kvasird.p2p.exchange")


def parse_reply(value: Any) -> list[tuple[str, tuple[str, ...]]]:
    d = schema.mapping(value, "px")
    out = []
    for item in schema.items(d, "peers", MAX_PEERS_PER_REPLY, "px"):
        entry = schema.mapping(item, "px.peers[]")
        pid = schema.text(entry, "id", 128, "px.peers[]")
        addrs = schema.text_list(entry, "addrs", MAX_ADDRS, MAX_ADDR_LEN, "px.peers[]")
        out.append((pid, tuple(a for a in addrs if a.endswith(f"/p2p/{pid}"))))
    return out


class PeerExchange:
    def __init__(self, host: IHost, peers: PeerTable, dialer: Dialer, interval_s: float) -> None:
        self._host = host
        self._peers = peers
        self._dialer = dialer
        self._interval = interval_s

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._host.set_stream_handler(PROTOCOL, self._serve)
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
                    if (other not in self._peers and addrs and self._dialer.room()
                            and self._dialer.due(other)):
                        nursery.start_soon(self._dialer.dial, list(addrs))

    async def _ask(self, pid: ID) -> list[tuple[str, tuple[str, ...]]]:
        with trio.fail_after(TIMEOUT_S):
            stream = await self._host.new_stream(pid, [PROTOCOL])
            try:
                await write_frame(stream, {"t": "px?"})
                return parse_reply(await read_frame(stream, _MAX_FRAME))
            finally:
                await stream.close()

    async def _serve(self, stream: INetStream) -> None:
        asker = stream.muxed_conn.peer_id.to_string()
        async with served(stream, "peer exchange", asker):
            with trio.fail_after(TIMEOUT_S):
                await read_frame(stream, 1024)
                peers = [{"id": p.peer_id, "addrs": list(p.addrs)}
                         for p in self._peers.snapshot() if p.addrs and p.peer_id != asker]
                await write_frame(stream, {"peers": peers[:MAX_PEERS_PER_REPLY]}, _MAX_FRAME)

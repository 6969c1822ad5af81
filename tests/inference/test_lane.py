"""Lanes: sealed records, tickets, and Channels moving a peer's requests onto a lane."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from kvasird.errors import WireError
from kvasird.inference import lane
from kvasird.inference.channel import MAX_FRAME, Channels, serve
from kvasird.inference.errors import HopFailed

from .test_channel import PROTO, handler, pair

KEY = bytes(range(32))


def sealed_pair(max_record: int = 1024) -> tuple[lane.SealedStream, lane.SealedStream,
                                                 trio.testing.MemoryReceiveStream]:
    a, b = trio.testing.memory_stream_pair()
    return (lane.SealedStream(a, KEY, True, max_record),
            lane.SealedStream(b, KEY, False, max_record), b)


async def test_sealed_records_round_trip_both_ways_and_are_not_plaintext() -> None:
    left, right, _ = sealed_pair()
    secret = b"hidden states 0123456789" * 4
    await left.write(secret)
    await left.write(b"second")
    assert await right.read(10) == secret[:10]  # short reads come from the same record
    assert await right.read() == secret[10:]
    assert await right.read() == b"second"
    await right.write(b"reply")
    assert await left.read() == b"reply"


async def test_a_tampered_or_replayed_record_ends_the_lane() -> None:
    a, b = trio.testing.lockstep_stream_pair()
    sender = lane.SealedStream(a, KEY, True, 1024)
    captured: list[bytes] = []

    async def capture() -> None:
        captured.append(await b.receive_some(4096))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(capture)
        await sender.write(b"pay 1 KVR")
    record = captured[0]
    for forged in (record[:-1] + bytes([record[-1] ^ 1]),   # a flipped tag bit
                   record + record):                         # the same record twice
        x, y = trio.testing.memory_stream_pair()
        reader = lane.SealedStream(y, KEY, False, 1024)
        await x.send_all(forged)
        if forged == record + record:
            assert await reader.read() == b"pay 1 KVR"
        with pytest.raises(WireError, match="authentication"):
            await reader.read()


async def test_oversized_record_header_is_refused_before_reading_it() -> None:
    x, y = trio.testing.memory_stream_pair()
    reader = lane.SealedStream(y, KEY, False, 1024)
    await x.send_all((1 << 30).to_bytes(4, "big"))
    with pytest.raises(WireError, match="outside 16"):
        await reader.read()


async def test_offers_are_single_use_bound_to_protocol_and_limited_per_peer() -> None:
    server = lane.LaneServer("127.0.0.1", 0, MAX_FRAME)
    served: list[str] = []

    async def serve_one(stream: Any, peer: str) -> None:
        served.append(peer)
        assert await stream.read() == b"hello"
        await stream.write(b"world")

    server.register("/p/1", serve_one)
    with pytest.raises(WireError, match="no lanes for /q/1"):
        server.offer("peer-a", "/q/1")
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        offer = server.offer("peer-a", "/p/1")
        stream = await lane.connect("127.0.0.1", offer, MAX_FRAME, 5)
        await stream.write(b"hello")
        assert await stream.read() == b"world" and served == ["peer-a"]
        with pytest.raises(WireError, match="did not confirm"):  # the ticket is spent
            await lane.connect("127.0.0.1", offer, MAX_FRAME, 5)
        wrong_key = {**server.offer("peer-a", "/p/1"), "key": bytes(32)}
        with pytest.raises(WireError, match="authentication"):
            await lane.connect("127.0.0.1", wrong_key, MAX_FRAME, 5)
        with pytest.raises(WireError, match="expected"):
            await lane.connect("127.0.0.1", {"port": "x"}, MAX_FRAME, 5)
        for _ in range(3 * lane.TICKETS_PER_PEER):
            server.offer("peer-b", "/p/1")
        assert sum(v[0] == "peer-b" for v in server._tickets.values()) == lane.TICKETS_PER_PEER
        assert server.refused == 1 and server.lanes == 2
        nursery.cancel_scope.cancel()


async def test_channels_move_requests_onto_a_lane_and_fall_back_when_it_breaks(
        tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        server = lane.LaneServer("127.0.0.1", 0, MAX_FRAME)
        server.register(PROTO, lambda s, peer: serve(s, handler, 10, peer=peer))
        await nursery.start(server.run)
        b.set_stream_handler(PROTO, lambda s: serve(s, handler, 10, lanes=server,
                                                    protocol=PROTO))
        channels = Channels(a)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        assert (await channels.request(peer, PROTO, {"n": 1}, 5))["echo"] == 1
        with trio.fail_after(5):
            while not channels.lane_open(peer, PROTO):
                await trio.sleep(0.01)
        for n in range(2, 6):  # over the lane now
            assert (await channels.request(peer, PROTO, {"n": n}, 5))["echo"] == n
        assert server.lanes == 1
        # the lane's TCP connection dies: requests go back to the libp2p channel
        await channels._lanes[(peer, PROTO)].stream.reset()
        with trio.fail_after(5):
            while channels.lane_open(peer, PROTO):
                await trio.sleep(0.01)
        assert (await channels.request(peer, PROTO, {"n": 7}, 5))["echo"] == 7
        # a request caught on a lane as it breaks fails (the caller fails over) and drops it
        await nursery.start(_renew_lane, channels, peer)
        closing = channels._lanes[(peer, PROTO)]
        async with trio.open_nursery() as inner:
            inner.start_soon(_expect_hop_failed, channels, peer)
            await trio.sleep(0.1)
            await closing.stream.reset()
        assert not channels.lane_open(peer, PROTO)
        nursery.cancel_scope.cancel()


async def test_a_peer_without_lanes_is_served_over_libp2p(tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        b.set_stream_handler(PROTO, lambda s: serve(s, handler, 10))  # offers no lanes
        channels = Channels(a)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        for n in range(5):
            assert (await channels.request(peer, PROTO, {"n": n}, 5))["echo"] == n
            await trio.sleep(0.05)
        assert not channels.lane_open(peer, PROTO)
        assert channels._lane_next[(peer, PROTO)] > time.monotonic() + 60  # not asked again soon
        nursery.cancel_scope.cancel()


async def _renew_lane(channels: Channels, peer: str, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    channels._lane_next.clear()
    await channels.request(peer, PROTO, {"n": 8}, 5)
    with trio.fail_after(5):
        while not channels.lane_open(peer, PROTO):
            await trio.sleep(0.01)
    task_status.started()


async def _expect_hop_failed(channels: Channels, peer: str) -> None:
    with pytest.raises(HopFailed):
        await channels.request(peer, PROTO, {"op": "slow", "s": 2, "n": 9}, 5)

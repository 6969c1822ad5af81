"""Lanes: sealed records, tickets, and Channels moving a peer's requests onto a lane."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from kvasird.errors import WireError
from kvasird.inference.errors import HopFailed, Refused
from kvasird.inference.transport import lane
from kvasird.inference.transport.channel import Channels, serve
from kvasird.wire import FrameReader
from kvasird.wire.rpc import MAX_FRAME, Channel, Intake
from tests.support import eventually_async

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


@contextlib.asynccontextmanager
async def socket_pair(max_record: int = MAX_FRAME
                      ) -> AsyncIterator[tuple[lane.SealedStream, lane.SealedStream]]:
    """Two sealed ends of a real loopback TCP connection (the lanes' fast path)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    client = await trio.testing.open_stream_to_socket_listener(listeners[0])
    server = await listeners[0].accept()
    try:
        yield (lane.SealedStream(client, KEY, True, max_record),
               lane.SealedStream(server, KEY, False, max_record))
    finally:
        for s in (client, server, *listeners):
            await trio.aclose_forcefully(s)


async def test_records_on_a_socket_arrive_whole_however_large() -> None:
    async with socket_pair() as (left, right):
        assert left._socket is not None  # this is the fast path under test
        big = secrets.token_bytes(8 << 20)  # far more than a socket buffer takes at once
        got: list[bytes] = []

        async def drain() -> None:
            reader = FrameReader(right, MAX_FRAME)
            got.extend([await reader.read_raw(), await reader.read_raw()])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await left.write(len(big).to_bytes(4, "big") + big)
            await left.write(b"\x00\x00\x00\x05after")
        assert got == [big, b"after"]


async def test_a_write_given_up_on_still_sends_its_record_whole() -> None:
    async with socket_pair() as (left, right):
        big = secrets.token_bytes(8 << 20)

        async def give_up_writing() -> None:
            with trio.move_on_after(0.05):  # the caller gives up while the record is half sent
                await left.write(big)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(give_up_writing)
            await trio.sleep(0.2)  # nobody reads yet: the socket is full
            got = b""
            while len(got) < len(big):
                got += await right.read(len(big) - len(got))
        assert got == big
        await left.write(b"next")
        assert await right.read() == b"next"


async def test_a_record_that_cannot_go_out_in_time_ends_the_lane() -> None:
    async with socket_pair() as (left, right):
        with pytest.raises(trio.BrokenResourceError, match="within 0.2 s"):
            await left.write(secrets.token_bytes(8 << 20), 0.2)  # the reader never reads
        with pytest.raises(trio.BrokenResourceError, match="lane ended"):
            await left.write(b"more")  # at once: the stream is cut mid-record


async def test_a_lane_whose_peer_is_gone_fails_its_writes() -> None:
    async with socket_pair() as (left, right):
        await right.close()
        with pytest.raises(trio.BrokenResourceError), trio.fail_after(5):
            for _ in range(100):  # the first writes may still land in the kernel's buffer
                await left.write(b"x" * 1024)
        assert await left.read() == b""  # and reading sees the end


async def test_a_busy_lane_lets_other_tasks_run() -> None:
    async with socket_pair() as (left, right):
        for i in range(64):
            await left.write(b"%d" % i)
        await trio.sleep(0.1)  # all 64 records wait in the receiver's socket
        turns = 0

        async def other() -> None:
            nonlocal turns
            while True:
                turns += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.lowlevel.checkpoint()
            before = turns
            got = [await right.read() for _ in range(64)]  # never has to wait for the socket
            assert turns - before >= 4  # one turn per QUICK_RUN records read
            nursery.cancel_scope.cancel()
        assert b"".join(got) == b"".join(b"%d" % i for i in range(64))


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
        wrong_key = dataclasses.replace(server.offer("peer-a", "/p/1"), key=bytes(32))
        with pytest.raises(WireError, match="authentication"):
            await lane.connect("127.0.0.1", wrong_key, MAX_FRAME, 5)
        with pytest.raises(WireError, match="expected"):
            lane.LaneOffer.from_wire({"port": "x"})
        for _ in range(3 * lane.TICKETS_PER_PEER):
            server.offer("peer-b", "/p/1")
        assert sum(v[0] == "peer-b" for v in server._tickets.values()) == lane.TICKETS_PER_PEER
        assert server.refused == 1 and server.lanes == 2
        nursery.cancel_scope.cancel()


async def offering(a: Any, b: Any, nursery: trio.Nursery
                   ) -> tuple[lane.LaneServer, Channels, str]:
    """b answers PROTO and offers lanes for it; a's channels, and b's peer id."""
    server = lane.LaneServer("127.0.0.1", 0, MAX_FRAME)
    server.register(PROTO, lambda s, peer: serve(s, handler, 10, peer=peer))
    await nursery.start(server.run)
    b.set_stream_handler(PROTO, lambda s: serve(s, handler, 10, lanes=server, protocol=PROTO))
    channels = Channels(a)
    await nursery.start(channels.run)
    return server, channels, b.get_id().to_string()


async def test_channels_move_requests_onto_a_lane_and_fall_back_when_it_breaks(
        tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        server, channels, peer = await offering(a, b, nursery)
        assert (await channels.request(peer, PROTO, {"n": 1}, 5))["echo"] == 1
        await eventually_async("the lane opens", lambda: channels.lane_open(peer, PROTO),
                               timeout=5, every=0.01)
        assert channels.on_libp2p() == []
        for n in range(2, 6):  # over the lane now
            assert (await channels.request(peer, PROTO, {"n": n}, 5))["echo"] == n
        assert server.lanes == 1
        # the lane's TCP connection dies: requests go back to the libp2p channel
        await channels._lanes[(peer, PROTO)].stream.reset()
        await eventually_async("the lane is closed", lambda: not channels.lane_open(peer, PROTO),
                               timeout=5, every=0.01)
        assert channels.on_libp2p() == [(peer, PROTO)]
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


async def test_a_lane_opens_over_a_websocket_connection(tmp_path: Path) -> None:
    """py-libp2p reports no remote address for a WebSocket connection: the lane goes to
    the IP of the peer's direct addresses instead (local nodes connect either way)."""
    async with pair(tmp_path, websocket=True) as (a, b), trio.open_nursery() as nursery:
        server, channels, peer = await offering(a, b, nursery)
        assert (await channels.request(peer, PROTO, {"n": 1}, 5))["echo"] == 1
        assert channels._open[(peer, PROTO)].stream.get_remote_address() is None
        await eventually_async("the lane opens", lambda: channels.lane_open(peer, PROTO),
                               timeout=5, every=0.01)
        assert (await channels.request(peer, PROTO, {"n": 2}, 5))["echo"] == 2
        assert server.lanes == 1 and channels.on_libp2p() == []
        nursery.cancel_scope.cancel()


async def test_a_peer_without_lanes_is_served_over_libp2p(tmp_path: Path,
                                                        mock_clock: MockClock) -> None:
    mock_clock.rate = 1  # real time for the hosts; the back-off's waits are jumped
    asked, asks = trio.open_memory_channel[float](16)

    async def no_lanes(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("op") == "lane":
            asked.send_nowait(trio.current_time())
        return await handler(caller, msg)

    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        b.set_stream_handler(PROTO, lambda s: serve(s, no_lanes, 10))  # offers no lanes
        channels = Channels(a)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        for n in range(5):
            assert (await channels.request(peer, PROTO, {"n": n}, 5))["echo"] == n
            await trio.sleep(0.05)
        assert not channels.lane_open(peer, PROTO)
        at = asks.receive_nowait()  # asked once, with the first request
        # asked again only after a while, and each time it failed after twice as long
        for wait in (2.0, 4.0, 8.0):
            mock_clock.jump(at + wait - 0.1 - trio.current_time())
            for n in range(2):  # the second's reply comes after any lane request of the first
                await channels.request(peer, PROTO, {"n": n}, 5)
            with pytest.raises(trio.WouldBlock):
                asks.receive_nowait()
            mock_clock.jump(0.2)
            await channels.request(peer, PROTO, {"n": 9}, 5)
            with trio.fail_after(5):
                at = await asks.receive()
        assert not channels.lane_open(peer, PROTO)
        nursery.cancel_scope.cancel()


async def _renew_lane(channels: Channels, peer: str, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    channels._lane_next.clear()
    await channels.request(peer, PROTO, {"n": 8}, 5)
    await eventually_async("the lane opens again", lambda: channels.lane_open(peer, PROTO),
                           timeout=5, every=0.01)
    task_status.started()


async def _expect_hop_failed(channels: Channels, peer: str) -> None:
    with pytest.raises(HopFailed):
        await channels.request(peer, PROTO, {"op": "slow", "s": 2, "n": 9}, 5)


async def test_a_stream_idle_past_its_limit_is_closed_and_a_busy_one_is_not() -> None:
    async with socket_pair() as (left, right):
        channel = Channel("server", left)
        async with trio.open_nursery() as nursery:
            ended = trio.Event()

            async def serving() -> None:
                await serve(right, handler, 0.3, peer="client")
                ended.set()

            nursery.start_soon(serving)
            nursery.start_soon(channel.read_replies)
            for n in range(6):  # 0.6 s of requests 0.1 s apart: never idle for 0.3 s
                assert (await channel.request({"n": n}, 5))["echo"] == n
                await trio.sleep(0.1)
            assert not ended.is_set()
            with trio.fail_after(2):
                await ended.wait()  # then 0.3 s without a frame ends it
            with pytest.raises(HopFailed):
                await channel.request({"n": 9}, 1)
            nursery.cancel_scope.cancel()


async def test_inline_one_way_messages_run_in_the_reader_in_order() -> None:
    async with socket_pair() as (left, right):
        channel = Channel("server", left)
        seen: list[str] = []
        two, four = trio.Event(), trio.Event()

        async def handle(peer: str, msg: dict[str, Any]) -> dict[str, Any]:
            await trio.sleep(msg.get("s", 0))
            seen.append(msg["name"])
            (two if len(seen) == 2 else four if len(seen) == 4 else trio.Event()).set()
            return {}

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve(right, handle, 0.5, peer="client",
                                             inline=lambda m: m["name"].startswith("inline")))
            nursery.start_soon(channel.read_replies)
            # spawned one-way messages overlap: the quick one finishes first
            await channel.notify({"name": "slow", "s": 0.2}, 5)
            await channel.notify({"name": "quick"}, 5)
            with trio.fail_after(5):
                await two.wait()
            # inline ones hold the reader: the next frame waits until the first is handled
            await channel.notify({"name": "inline slow", "s": 0.2}, 5)
            await channel.notify({"name": "inline quick"}, 5)
            with trio.fail_after(5):
                await four.wait()
            assert seen == ["quick", "slow", "inline slow", "inline quick"]
            # an inline message handled for longer than the idle limit is not cut off
            await channel.notify({"name": "inline long", "s": 1.0}, 5)
            await eventually_async("the long inline message is handled",
                                   lambda: "inline long" in seen, timeout=5)
            nursery.cancel_scope.cancel()


def test_the_ip_of_a_tcp_address_is_where_lanes_go() -> None:
    assert lane.tcp_ip("/ip4/127.0.0.1/tcp/4001/ws/p2p/12D3KooW") == "127.0.0.1"
    assert lane.tcp_ip("/ip6/::1/tcp/4001") == "::1"
    assert lane.tcp_ip("/dns4/example.org/tcp/4001") is None
    assert lane.tcp_ip("/ip4/198.51.100.1/udp/4001/quic") is None


async def test_a_lane_refuses_a_large_record_of_a_peer_the_server_works_for_no_one_of(
        ) -> None:
    """The record's length decides before its body is read (into memory: nothing of it is
    kept); the sender reads why, and the lane ends."""
    async with socket_pair() as (left, right):
        channel = Channel("server", left)
        async with trio.open_nursery() as nursery:
            intake = Intake(lambda peer: peer == "friend")
            nursery.start_soon(lambda: serve(right, handler, 5, peer="client", intake=intake))
            nursery.start_soon(channel.read_replies)
            assert (await channel.request({"n": 1, "blob": b"x" * (1 << 20)}, 5))["echo"] == 1
            with trio.fail_after(5), pytest.raises(Refused) as exc:
                await channel.request({"n": 2, "blob": b"x" * (3 << 20)}, 5)
            assert exc.value.code == "bad" and "no session here" in exc.value.detail
            assert channel.closed and intake._held == {}
            nursery.cancel_scope.cancel()

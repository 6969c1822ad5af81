"""Request/response with ids over one long-lived stream, between two real libp2p hosts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import multiaddr
import pytest
import trio
from libp2p.abc import IHost
from libp2p.peer.peerinfo import PeerInfo

from kvasird.errors import WireError
from kvasird.identity.nodekey import create_node_key
from kvasird.inference.errors import (
    UNREACHABLE_S,
    HopFailed,
    Refusal,
    Refused,
    Unreachable,
    sentence,
)
from kvasird.inference.transport.channel import Channels, serve
from kvasird.p2p.host import build_host, parse_listen
from kvasird.wire.rpc import SMALL_FRAME, SMALL_IN_FLIGHT, Intake

PROTO = "/kvasir/test-channel/1"


@asynccontextmanager
async def pair(tmp: Path, websocket: bool = False) -> AsyncIterator[tuple[IHost, IHost]]:
    """A caller and a server host, connected (TCP or WebSocket + Noise + yamux on
    127.0.0.1)."""
    async with AsyncExitStack() as stack:
        hosts = []
        for i in range(2):
            listen = parse_listen(("/ip4/127.0.0.1/tcp/0" + ("/ws" if websocket else ""),))
            host = build_host(create_node_key(tmp / f"{i}.key"), listen, [], 8)
            await stack.enter_async_context(host.run([multiaddr.Multiaddr(a) for a in listen]))
            hosts.append(host)
        await hosts[0].connect(PeerInfo(hosts[1].get_id(), hosts[1].get_addrs()))
        yield hosts[0], hosts[1]
        for host in hosts:
            for pid in list(host.get_network().connections):
                await host.get_network().close_peer(pid)


async def handler(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
    if msg.get("op") == "slow":
        await trio.sleep(msg["s"])
    if msg.get("op") == "refuse":
        raise Refusal("busy", "full")
    if msg.get("op") == "odd":  # a peer answering with a code outside the closed set
        return {"error": "why not", "code": "teapot"}
    return {"echo": msg.get("n")}


async def test_concurrent_requests_share_one_stream_and_get_their_own_replies(
        tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        b.set_stream_handler(PROTO, lambda s: serve(s, handler, idle_s=10))
        channels = Channels(a)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        got: dict[int, Any] = {}

        async def ask(n: int) -> None:
            msg = {"op": "slow", "s": 0.2 - n * 0.02, "n": n}
            got[n] = (await channels.request(peer, PROTO, msg, 5))["echo"]

        async with trio.open_nursery() as inner:
            for n in range(8):
                inner.start_soon(ask, n)
        assert got == {n: n for n in range(8)}
        assert len(channels._open) == 1
        with pytest.raises(Refused) as exc:
            await channels.request(peer, PROTO, {"op": "refuse"}, 5)
        assert exc.value.code == "busy" and exc.value.detail == "full"
        with pytest.raises(Refused) as exc:
            await channels.request(peer, PROTO, {"op": "odd"}, 5)
        assert exc.value.code == "bad" and exc.value.detail == "why not"
        nursery.cancel_scope.cancel()


async def test_a_request_without_an_answer_fails_in_time_and_drops_the_channel(
        tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        b.set_stream_handler(PROTO, lambda s: serve(s, handler, idle_s=10))
        channels = Channels(a)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        with trio.fail_after(3), pytest.raises(HopFailed, match="within 0.2 s"):
            await channels.request(peer, PROTO, {"op": "slow", "s": 5}, 0.2)
        assert channels._open == {}
        assert (await channels.request(peer, PROTO, {"n": 1}, 5)) == {"echo": 1, "id": 1}
        nursery.cancel_scope.cancel()


async def test_one_way_messages_get_no_answer_and_an_unknown_peer_is_unreachable(
        tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    async def record(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        seen.append(msg)
        if msg.get("op") == "refuse":
            raise Refusal("bad", "no")
        return {"echo": msg.get("n")}

    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        b.set_stream_handler(PROTO, lambda s: serve(s, record, idle_s=10))
        channels = Channels(a)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        await channels.notify(peer, PROTO, {"op": "refuse"}, 5)  # its failure is the peer's
        await channels.notify(peer, PROTO, {"n": 1}, 5)
        # a request after them gets its own answer: nothing answered the one-way ones
        reply = await channels.request(peer, PROTO, {"n": 2}, 5)
        assert reply["echo"] == 2
        assert [m["id"] for m in seen if m.get("op") != "lane"] == [0, 0, reply["id"]]
        stranger = create_node_key(tmp_path / "x.key").peer_id.to_string()
        with trio.fail_after(10), pytest.raises(Unreachable) as exc:
            await channels.notify(stranger, PROTO, {"n": 3}, 5)
        assert sentence(exc.value) == UNREACHABLE_S < 300
        nursery.cancel_scope.cancel()


async def test_a_frame_its_protocol_cannot_parse_is_answered_bad_and_never_handled(
        tmp_path: Path) -> None:
    seen: list[Any] = []

    def parse(msg: dict[str, Any]) -> int:
        if not isinstance(msg.get("n"), int):
            raise WireError("test.n: expected an integer")
        return msg["n"]

    async def record(caller: str, n: int) -> dict[str, Any]:
        seen.append(n)
        return {"echo": n}

    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        b.set_stream_handler(PROTO, lambda s: serve(s, record, idle_s=10, parse=parse))
        channels = Channels(a, lanes=False)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        with pytest.raises(Refused) as exc:
            await channels.request(peer, PROTO, {"n": "1"}, 5)
        assert exc.value.code == "bad" and "test.n" in exc.value.detail
        assert (await channels.request(peer, PROTO, {"n": 2}, 5))["echo"] == 2
        assert seen == [2]  # the handler got the parsed message, and only that one
        nursery.cancel_scope.cancel()


def blob(mib: float) -> bytes:
    return b"x" * int(mib * (1 << 20))


async def test_a_peer_the_server_works_for_no_one_of_sends_only_small_frames(
        tmp_path: Path) -> None:
    """A frame over SMALL_FRAME from a peer the server does not work for is refused from
    its length, unread and unhandled, with a reason the caller's request raises; once the
    server works for the peer, the same frame is answered."""
    admitted, seen = [False], []

    async def record(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        seen.append(len(msg.get("blob", b"")))
        return {"echo": msg.get("n")}

    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        intake = Intake(lambda peer: admitted[0])
        b.set_stream_handler(PROTO, lambda s: serve(s, record, idle_s=10, intake=intake))
        channels = Channels(a, lanes=False)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        assert (await channels.request(peer, PROTO, {"n": 1, "blob": blob(1)}, 5))["echo"] == 1
        with trio.fail_after(5), pytest.raises(Refused) as exc:
            await channels.request(peer, PROTO, {"n": 2, "blob": blob(3)}, 5)
        assert exc.value.code == "bad" and "no session here" in exc.value.detail
        assert f"exceeds the limit of {SMALL_FRAME}" in exc.value.detail
        assert seen == [1 << 20] and intake._held == {}
        admitted[0] = True
        assert (await channels.request(peer, PROTO, {"n": 3, "blob": blob(3)}, 5))["echo"] == 3
        nursery.cancel_scope.cancel()


async def test_a_peer_has_only_so_many_bytes_of_frames_in_flight(tmp_path: Path) -> None:
    """Frames of a peer the server does not work for wait, unread, while SMALL_IN_FLIGHT
    bytes of its frames are being handled; a peer it works for has room for many more."""
    admitted, now, most = [False], [0], [0]

    async def slow(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        now[0] += 1
        most[0] = max(most[0], now[0])
        await trio.sleep(0.3)
        now[0] -= 1
        return {"echo": msg["n"]}

    async with pair(tmp_path) as (a, b), trio.open_nursery() as nursery:
        intake = Intake(lambda peer: admitted[0])
        b.set_stream_handler(PROTO, lambda s: serve(s, slow, idle_s=10, intake=intake))
        channels = Channels(a, lanes=False)
        await nursery.start(channels.run)
        peer = b.get_id().to_string()
        size = SMALL_IN_FLIGHT / (1 << 20) * 0.4  # two fit in the budget, not three

        async def four() -> None:
            async with trio.open_nursery() as inner:
                for n in range(4):
                    inner.start_soon(channels.request, peer, PROTO, {"n": n, "blob": blob(size)},
                                     10)

        with trio.fail_after(10):
            await four()
        assert most[0] == 2
        admitted[0], most[0] = True, 0
        with trio.fail_after(10):
            await four()
        assert most[0] == 4 and intake._held == {}
        nursery.cancel_scope.cancel()

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

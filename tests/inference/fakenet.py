"""Named peers in one process: their stage servers (and expert servers) joined by an
in-process transport that can lose a peer, cut a single link, or put a fault in front of
one peer's handlers.

It offers what the client side uses of Channels (``request``, ``notify``), so
SwarmGenerator and ExpertDispatcher run on it unchanged, and it is every StageServer's
``send``: a one-way message is in flight in ``nursery`` (not waited for), as on a stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from kvasird.errors import KvasirError
from kvasird.inference.client.routing import PeerHoldings
from kvasird.inference.client.swarm import Inbox
from kvasird.inference.errors import HopFailed, Refusal, Refused, Unreachable
from kvasird.inference.protocol import EXPERT_PROTOCOL, STAGE_PROTOCOL, tensors
from kvasird.inference.protocol.delegation import Verifier
from kvasird.inference.server.engine import Served
from kvasird.inference.server.experts import ExpertServer
from kvasird.inference.server.stage import Send, StageServer

NETWORK = "fakenet"
"""The network the expert workers check delegations against."""
Handle = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
Fault = Callable[[Handle], Handle]
"""What stands in front of a peer's handlers: its requests and one-way messages pass it."""


def hung(when: Callable[[dict[str, Any]], bool]) -> Fault:
    """A peer that takes the messages `when` picks and never answers nor passes them on."""
    def fault(handle: Handle) -> Handle:
        async def hanging(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
            if when(msg):
                await trio.sleep_forever()
            return await handle(caller, msg)
        return hanging
    return fault


def lying(handle: Handle) -> Handle:
    """An expert worker whose outputs are scaled and shifted off the true ones."""
    async def lie(caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        reply = await handle(caller, msg)
        out = tensors.decode(reply["out"], "out", ("f32", "f16"), (None, None, None))
        return {**reply, "out": tensors.encode(out * 1.5 + 0.01, reply["out"]["dt"])}
    return lie


class FakeNet:
    """Named peers; `down` peers and `cut` links (from, to) refuse to connect."""

    def __init__(self, served: dict[str, Served], me: str = "gw", *, max_sessions: int = 8,
                 experts: dict[str, Served] | None = None,
                 servers: dict[str, type[StageServer]] | None = None) -> None:
        self.me, self.inbox = me, Inbox()
        self.nursery: trio.Nursery | None = None
        """Where one-way messages are in flight (`running`, or a test's own nursery)."""
        self.down: set[str] = set()
        self.cut: set[tuple[str, str]] = set()
        self.faults: dict[str, Fault] = {}
        """Peer -> the fault in front of its handlers."""
        self.unlisted: set[str] = set()
        """Peers missing from the coverage map (`holders`): their records are late."""
        self.sent: list[tuple[str, str, str]] = []
        """(from, to, op) of every one-way message sent."""
        kinds = servers or {}  # peer -> its stage server's class (a liar's)
        self.servers = {n: kinds.get(n, StageServer)(
            lambda: "m", lambda s=s: s, max_sessions=max_sessions, idle_s=60, wire_dtype="f32",
            me=n, send=self._sender(n), deliver=self.inbox.deliver if n == me else None,
            delegations=Verifier(NETWORK))
            for n, s in served.items()}
        self.experts = {n: ExpertServer(lambda s=s: s, window_s=0, wire_dtype="f32",
                                        delegations=Verifier(NETWORK))
                        for n, s in (experts or {}).items()}
        self._holdings = {n: s.holdings for n, s in {**served, **(experts or {})}.items()}

    def holders(self) -> list[PeerHoldings]:
        """The coverage map: what every listed peer serves."""
        return [PeerHoldings(n, h.head, h.windows, h.experts)
                for n, h in self._holdings.items() if n not in self.unlisted]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[trio.Nursery]:
        """Messages in flight while the body runs; those still in flight are cancelled."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            try:
                yield nursery
            finally:
                nursery.cancel_scope.cancel()

    def handler(self, peer: str, protocol: str = STAGE_PROTOCOL) -> Handle:
        """What answers `protocol` at `peer`, its fault in front."""
        handle = self.experts[peer].handle if protocol == EXPERT_PROTOCOL \
            else self.servers[peer].handle
        fault = self.faults.get(peer)
        return handle if fault is None else fault(handle)

    def _reach(self, src: str, dst: str) -> None:
        if dst in self.down or (src, dst) in self.cut or \
                dst not in self.servers and dst not in self.experts:
            raise Unreachable(dst, "connection refused")

    def _sender(self, src: str) -> Send:
        async def send(peer: str, msg: dict[str, Any]) -> None:
            self._reach(src, peer)
            assert self.nursery is not None, "one-way messages fly inside `running()`"
            self.sent.append((src, peer, msg["op"]))
            self.nursery.start_soon(self._arrive, peer, src, msg)
        return send

    async def _arrive(self, peer: str, src: str, msg: dict[str, Any]) -> None:
        with contextlib.suppress(KvasirError):  # a one-way message's failure is its own
            await self.handler(peer)(src, msg)

    # what SwarmGenerator and ExpertDispatcher use of Channels
    async def request(self, peer: str, protocol: str, msg: dict[str, Any],
                      wait_s: float) -> dict[str, Any]:
        self._reach(self.me, peer)
        try:
            with trio.fail_after(wait_s):
                return await self.handler(peer, protocol)(self.me, msg)
        except trio.TooSlowError:
            raise HopFailed(peer, f"no answer within {wait_s:g} s") from None
        except Refusal as exc:  # answered as the transport answers: with its code
            raise Refused(peer, exc.code, exc.detail[:500]) from None
        except KvasirError as exc:  # and any other error of the peer's as "bad"
            raise Refused(peer, "bad", str(exc)[:500]) from None

    async def notify(self, peer: str, protocol: str, msg: dict[str, Any], wait_s: float) -> None:
        await self._sender(self.me)(peer, msg)


def no_experts(layer: int, first: int, end: int) -> Any:
    """The expert dispatcher of a dense model's engine: never called."""
    raise AssertionError("a dense model dispatches nothing")

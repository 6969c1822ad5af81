"""Errors of the swarm data plane (the generation errors themselves live in api).

A refusal has two sides. The server raises a Refusal (this node will not do what was
asked); the transport answers it as {"error": detail, "code": code}. The caller's channel
turns that answer into a Refused naming the peer, which failover routes around.

    KvasirError (kvasird.errors)
    └── Refusal            raised by a server: this node refuses a peer's request, with a
                           Code and a reason
    PeerError (kvasird.errors)
    └── HopFailed          a stage or worker failed, refused or timed out: route around it
        ├── Refused        it answered with a Refusal's code and reason
        ├── Silent         it did not answer in time, though nothing broke (busy, or hung)
        └── Unreachable    no stream to it could be opened (it may only be not dialled yet)
    ComputeError (kvasird.compute.errors)
    └── NoWorkers          no fit peer holds experts a stage must dispatch (a stage answers "busy")
"""

from __future__ import annotations

from typing import Any, Literal, cast, get_args

from kvasird.compute.errors import ComputeError
from kvasird.errors import KvasirError, PeerError

Code = Literal["busy", "gone", "bad", "unpaid", "unreachable", "broken"]
"""Why a peer refused, the whole closed set:
    busy         out of capacity now (sessions, KV room, expert workers): retry elsewhere, soon
    gone         no such session (expired, or the node restarted); on a forwarded chain, the
                 next hop failed
    bad          the request was malformed or asked for what this node does not serve
    unpaid       this node works only for gateways that pay it (a paid network)
    unreachable  on a forwarded chain: no stream to the next hop could be opened
    broken       the named peer's output was unusable (NaN or infinity: its weights may be
                 corrupt): the refusing node's own, or on a forwarded chain the hop before
                 it, which sent such rows on unchecked
A node older than a code reads it as "bad", which blames the refusing node all the same."""
CODES: frozenset[str] = frozenset(get_args(Code))


def code_of(value: Any) -> Code:
    """A code read from a peer: itself when it is one of CODES, else "bad"."""
    return cast(Code, value) if isinstance(value, str) and value in CODES else "bad"


class Refusal(KvasirError):
    """This node refuses a request; the transport answers the caller with `code` and
    `detail` (a client sees it as Refused)."""

    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code: Code = code
        self.detail = detail

    def to_wire(self) -> dict[str, Any]:
        return {"error": self.detail[:500], "code": self.code}


class HopFailed(PeerError):
    """A peer on the route failed; the caller replaces it and replays (failover)."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer {peer[:16]}… failed: {reason}")
        self.peer = peer
        self.reason = reason


class Refused(HopFailed):
    """The peer answered, but refused (its Refusal): ``code`` says why, one of CODES."""

    def __init__(self, peer: str, code: Code, reason: str) -> None:
        super().__init__(peer, f"{code}: {reason}")
        self.code: Code = code
        self.detail = reason


class Silent(HopFailed):
    """The peer did not answer in time, though nothing broke: busy on a loaded machine,
    or hung. Unlike a broken stream or a refused connection, one missed answer proves
    little."""


class Unreachable(HopFailed):
    """No stream to the peer could be opened. Before any work was sent, this says little
    about the peer (we may hold no connection to it yet, a relay may be slow): it is
    avoided for UNREACHABLE_S, not the full sentence of a peer that failed at work."""


UNREACHABLE_S = 30.0
FAILED_S = 15.0
"""A first failure at work (a timeout, a broken stream, a refusal): short, because the
usual cause is a peer that restarts or is still loading, and a 300 s sentence turned every
restart into a five-minute outage of the windows only it served (#24's churn soak)."""


def sentence(exc: HopFailed) -> float:
    """The first sentence of a peer that failed with `exc` (routing.Fitness.failed doubles
    it for each failure in a row, up to the configured unfit_s)."""
    return UNREACHABLE_S if isinstance(exc, Unreachable) else FAILED_S


class NoWorkers(ComputeError):
    """No fit peer holds some experts a layer needs right now; transient (the market fills
    the gap, or a worker's sentence ends)."""

"""Errors of the swarm data plane (the generation errors themselves live in api).

    PeerError (kvasird.errors)
    └── HopFailed          a stage or worker failed, refused or timed out: route around it
        ├── Refused        it answered with a reason (busy, unknown session, bad request)
        └── Unreachable    no stream to it could be opened (it may only be not dialled yet)
    ComputeError (kvasird.compute.errors)
    └── NoWorkers          no fit peer holds experts a stage must dispatch (a stage answers "busy")
"""

from __future__ import annotations

from kvasird.compute.errors import ComputeError
from kvasird.errors import PeerError


class HopFailed(PeerError):
    """A peer on the route failed; the caller replaces it and replays (failover)."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer {peer[:16]}… failed: {reason}")
        self.peer = peer
        self.reason = reason


class Refused(HopFailed):
    """The peer answered, but refused: ``code`` is "busy", "gone" or "bad"."""

    def __init__(self, peer: str, code: str, reason: str) -> None:
        super().__init__(peer, f"{code}: {reason}")
        self.code = code
        self.detail = reason


class Unreachable(HopFailed):
    """No stream to the peer could be opened. Before any work was sent, this says little
    about the peer (we may hold no connection to it yet, a relay may be slow): it is
    avoided for UNREACHABLE_S, not the full sentence of a peer that failed at work."""


UNREACHABLE_S = 30.0


def sentence(exc: HopFailed) -> float | None:
    """How long a peer that failed with `exc` is avoided (None: the configured unfit_s)."""
    return UNREACHABLE_S if isinstance(exc, Unreachable) else None


class NoWorkers(ComputeError):
    """No fit peer holds some experts a layer needs right now; transient (the market fills
    the gap, or a worker's sentence ends)."""

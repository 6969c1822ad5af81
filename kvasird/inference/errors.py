"""Errors of the swarm data plane (the generation errors themselves live in api).

    PeerError (kvasird.errors)
    └── HopFailed          a stage or worker failed, refused or timed out: route around it
        └── Refused        it answered with a reason (busy, unknown session, bad request)
"""

from __future__ import annotations

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

"""Errors of the swarm data plane (the generation errors themselves live in api).

A refusal has two sides. The server raises a Refusal (this node will not do what was
asked); the transport answers it as {"error": detail, "code": code}. The caller's channel
turns that answer into a Refused naming the peer, which failover routes around. Those of
a peer call are the rpc's (kvasird.wire.rpc, imported here for inference's modules); this
module adds how long a failed peer is avoided, and NoWorkers.

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

from kvasird.compute.errors import ComputeError
from kvasird.wire.rpc import CODES, Code, HopFailed, Refusal, Refused, Silent, Unreachable, code_of

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


__all__ = [
    "CODES",
    "FAILED_S",
    "UNREACHABLE_S",
    "Code",
    "HopFailed",
    "NoWorkers",
    "Refusal",
    "Refused",
    "Silent",
    "Unreachable",
    "code_of",
    "sentence",
]

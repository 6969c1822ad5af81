"""Unfit verdicts on gossip: a node whose spot check caught a peer out of tolerance (a
stage checking a worker, a gateway checking a stage: inference.client.spotcheck) tells
the network.

    topic "unfit":  {"v": 1, "peer": accuser, "seq", "ts", "accused", "reason"}

One accusation is not proof (an accuser may lie too), so a node avoids a peer on
gossip alone only once `quorum` distinct peers accused it within `window_s`; its own
spot checks mark a worker at once. Messages pass the same gate as market records
(signer = claimed peer, clock skew, increasing sequence, rate) before they count: their
stamps are unix time, which peers share; the window is counted on an injected monotonic
clock (a test's own), so a clock step neither sentences nor pardons anyone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2

from kvasird.errors import WireError
from kvasird.inference.client.routing import Fitness
from kvasird.logs import get_logger
from kvasird.market.gate import RecordGate, Stale
from kvasird.p2p.gossip import Gossip
from kvasird.wire import pack, schema, unpack
from kvasird.wire.protocols import UNFIT_TOPIC

SCHEMA_VERSION = 1
MAX_VERDICT_BYTES = 4096
log = get_logger("kvasird.inference.verdicts")


@dataclass(frozen=True)
class Verdict:
    peer: str
    """The accuser (the gossip signer)."""
    seq: int
    """Strictly increasing per accuser."""
    ts: float
    """Accuser's unix time."""
    accused: str
    """Peer id of the worker or stage found out of tolerance."""
    reason: str
    """What the spot check saw."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "peer": self.peer,
            "seq": self.seq,
            "ts": self.ts,
            "accused": self.accused,
            "reason": self.reason,
        }

    @staticmethod
    def from_wire(value: Any) -> Verdict:
        d = schema.mapping(value, "unfit")
        if d.get("v") != SCHEMA_VERSION:
            raise WireError(f"unfit.v: unsupported schema version {d.get('v')!r}")
        return Verdict(
            schema.text(d, "peer", 128, "unfit"),
            schema.integer(d, "seq", 0, 2**62, "unfit"),
            schema.number(d, "ts", 0, 2**40, "unfit"),
            schema.text(d, "accused", 128, "unfit"),
            schema.text(d, "reason", 256, "unfit"),
        )


class Verdicts:
    """Publishes our accusations; counts others' and sentences on a quorum."""

    def __init__(
        self,
        gossip: Gossip,
        me: str,
        fitness: Fitness,
        quorum: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gossip, self.me, self.fitness = gossip, me, fitness
        self.quorum, self.window_s, self.clock = quorum, window_s, clock
        self.gate = RecordGate()
        self.accusers: dict[str, dict[str, float]] = {}
        """Accused peer -> accuser -> when (on `clock`)."""
        self._seq = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.gossip.set_validator(UNFIT_TOPIC, self._validate)
        sub = await self.gossip.subscribe(UNFIT_TOPIC)
        task_status.started()
        while True:  # applied in the validator; keep the subscription drained
            await sub.get()

    async def accuse(self, accused: str, reason: str) -> None:
        self._seq = max(self._seq + 1, time.time_ns() // 1_000_000)
        verdict = Verdict(self.me, self._seq, time.time(), accused, reason[:256])
        try:
            await self.gossip.publish(UNFIT_TOPIC, pack(verdict.to_wire()))
        except Exception as exc:  # noqa: BLE001 - no peers, or one died mid-send
            log.debug("verdict not published", error=repr(exc))

    async def _validate(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        signer = ID(msg.from_id).to_string()
        try:
            if len(msg.data) > MAX_VERDICT_BYTES:
                raise WireError(f"verdict of {len(msg.data)} bytes")
            verdict = Verdict.from_wire(unpack(msg.data, MAX_VERDICT_BYTES))
            self.gate.check(UNFIT_TOPIC, signer, verdict.peer, verdict.seq, verdict.ts, time.time())
        except Stale:
            return True
        except WireError as exc:
            log.info("unfit verdict refused", signer=signer, reason=str(exc)[:200])
            return False
        self.apply(verdict)
        return True

    def apply(self, verdict: Verdict) -> None:
        if verdict.accused == self.me:
            return
        now = self.clock()
        accusers = self.accusers.setdefault(verdict.accused, {})
        accusers[verdict.peer] = now
        for who in [w for w, t in accusers.items() if now - t > self.window_s]:
            del accusers[who]
        if len(accusers) >= self.quorum and verdict.peer != self.me:
            self.fitness.mark(
                verdict.accused, f"accused by {len(accusers)} peers: {verdict.reason}"
            )

"""Ledgers: what a hop keeps of each session's steps, to commit to at close and show later.

A hop on a route of several peers computes most steps forwarded hop to hop: the gateway
never sees those rows, and a replay relayed through the gateway can be told from the real
thing, so a hop could compute the relayed steps honestly and lie on the rest. So every
step a hop computes is written down here, as it was received and as it was sent (views of
the frames, no copies):

    step ─▶ StageServer ─▶ Ledgers.record(key, Shown)     digests + the rows (within budget)
    close ─▶ Ledgers.close(key) ─▶ Closed.steps            the commitment: digests, in order
    reveal ─▶ Ledgers.show(key, first, last) ─▶ Revealed   the rows, kept KEEP_S after close

The gateway compares each hop's output digests with the next hop's input digests, draws
a hop and a step, asks for the rows up to it, checks them against the commitment, and
recomputes the step from them on other holders of the hop's part (client.swarm). A hop is
bound to its rows before it learns which step is checked.

Memory: the rows of a step are its input and output as they travelled (f16 by default):
4 x n_embd bytes a position, against a KV cache of 4 x n_kv_embd bytes a position a layer,
so well under the session's own KV on a hop of several layers. All sessions' rows
together are held within KEEP_BYTES: closed sessions' go first, oldest first; past it a
step keeps its digests only, and its session cannot be shown (the gateway then pays the
hop nothing for it: a hop that cannot show its work is not paid for it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from kvasird.inference.errors import Refusal
from kvasird.inference.protocol.stage import MAX_STEPS, Shown
from kvasird.inference.protocol.tensors import digest

KEEP_S = 120.0
"""How long a closed session's steps are kept for the owner to ask to see them."""
KEEP_BYTES = 512 << 20
"""Most bytes of rows kept across all sessions, open and closed."""
SHOW_BYTES = 16 << 20
"""Most bytes of rows one Revealed carries (the owner asks again for the rest)."""


class Ledger:
    """One session's steps: the digests of every step, and the rows while they fit."""

    def __init__(self) -> None:
        self.digests = bytearray()
        """Per step: the digest of its input, then of its output."""
        self.steps: list[Shown | None] = []
        """Per step: its rows, or None where they were not kept."""
        self.nbytes = 0

    def commitment(self) -> bytes:
        return bytes(self.digests)


def size(step: Shown) -> int:
    return step.x.nbytes + step.out.nbytes


class Ledgers:
    """Every session's ledger on this node, open and lately closed, within a byte budget."""

    def __init__(
        self,
        keep_s: float = KEEP_S,
        keep_bytes: int = KEEP_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keep_s, self.keep_bytes, self.clock = keep_s, keep_bytes, clock
        self.open: dict[Hashable, Ledger] = {}
        self.closed: OrderedDict[Hashable, tuple[Ledger, float]] = OrderedDict()
        """Closed sessions' ledgers, oldest first, with when they closed."""
        self.nbytes = 0
        self.dropped = 0
        """Steps whose rows were not kept (over budget): their sessions cannot be shown."""

    def begin(self, key: Hashable) -> None:
        """A session (re)opened under `key`: a new ledger."""
        self._forget(key)
        self.open[key] = Ledger()

    def record(self, key: Hashable, step: Shown) -> None:
        """A step `key`'s session computed: its digests always, its rows if they fit."""
        ledger = self.open.get(key)
        if ledger is None or len(ledger.steps) >= MAX_STEPS:
            return
        ledger.digests += digest(step.x, step.dt) + digest(step.out, step.out_dt)
        n = size(step)
        self._expire(n)
        if self.nbytes + n > self.keep_bytes:
            self.dropped += 1
            ledger.steps.append(None)
            return
        ledger.steps.append(step)
        ledger.nbytes += n
        self.nbytes += n

    def close(self, key: Hashable) -> bytes:
        """The session ended: its commitment (kept, with its rows, for KEEP_S)."""
        ledger = self.open.pop(key, None)
        if ledger is None:
            return b""
        self.closed[key] = (ledger, self.clock())
        self._expire(0)
        return ledger.commitment()

    def show(self, key: Hashable, first: int, last: int) -> tuple[Shown, ...]:
        """Steps first..last (as many as fit in SHOW_BYTES, at least one) of `key`'s
        session; Refusal "gone" when it is not known, or its rows were not all kept."""
        self._expire(0)
        ledger = self.open.get(key) or (self.closed[key][0] if key in self.closed else None)
        if ledger is None:
            raise Refusal(
                "gone", "no such session's steps here (closed too long ago, or this node restarted)"
            )
        out: list[Shown] = []
        total = 0
        for step in ledger.steps[first : last + 1]:
            if step is None:
                raise Refusal(
                    "gone", "this session's rows were not kept (over this node's budget for them)"
                )
            total += size(step)
            if out and total > SHOW_BYTES:
                break
            out.append(step)
        return tuple(out)

    def _forget(self, key: Hashable) -> None:
        ledger = self.open.pop(key, None)
        if ledger is None and key in self.closed:
            ledger = self.closed.pop(key)[0]
        if ledger is not None:
            self.nbytes -= ledger.nbytes

    def _expire(self, need: int) -> None:
        """Drop closed ledgers past KEEP_S, and the oldest closed ones while `need` more
        bytes would not fit."""
        now = self.clock()
        while self.closed:
            key, (ledger, at) = next(iter(self.closed.items()))
            if now - at <= self.keep_s and self.nbytes + need <= self.keep_bytes:
                break
            del self.closed[key]
            self.nbytes -= ledger.nbytes

"""ExpertServer: "/kvasir/experts/1", (layer, rows, local ids) ─▶ expert outputs.

Requests for one (worker, layer) that arrive while one is being led into a batch join it:
one ggml call for all of them. Before anything else a request must prove whose sessions
its rows belong to: each gateway's signed delegation to the caller (protocol.delegation)
with its rows; each gateway is then admitted for the units of its own rows (on a paid
network: staked, paying, and metered). Only then are the rows widened and computed. The
handler sees only requests kvasird.inference.protocol.experts has parsed; what it checks is
what depends on this node's workers (the layer, the experts held, the row width).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from kvasird.compute.errors import ComputeError
from kvasird.compute.experts import ExpertWorker
from kvasird.inference.errors import Refusal
from kvasird.inference.protocol.delegation import Verifier
from kvasird.inference.protocol.experts import (
    ADMITTED_S,
    ExpertRequest,
    Outputs,
    parse,
    selections,
)
from kvasird.inference.server.engine import INLINE_TOKENS, Served, run_short
from kvasird.inference.server.stage import Admit, admit_all


class ExpertServer:
    """Answers expert requests with this node's workers, batching per layer.

    Requests for one (worker, layer) that arrive while one is being led into a batch join
    it: one ggml call for all of them. The leader waits `window_s` for company only when
    the previous batch of that layer had more than one request (concurrent sessions);
    a single session's requests go straight to compute.
    """

    def __init__(
        self,
        served: Callable[[], Served | None],
        *,
        window_s: float,
        wire_dtype: str,
        delegations: Verifier,
        admit: Admit = admit_all,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.served, self.window_s, self.wire_dtype = served, window_s, wire_dtype
        self.delegations, self.admit, self.clock = delegations, admit, clock
        self._admitted: dict[str, float] = {}
        """Caller -> when a request of its was last admitted (on `clock`)."""
        self._queues: dict[tuple[int, int], list[_Job]] = {}
        self._last: dict[tuple[int, int], int] = {}
        self.rows = 0
        """Rows computed (for the bench and load reports)."""
        self.calls = 0
        """ggml calls made (rows / calls = the batch size achieved)."""

    async def handle(self, caller: str, msg: dict[str, Any]) -> dict[str, Any]:
        """A request in its wire form (from a caller in this process): parsed, answered."""
        return await self.answer(caller, parse(msg))

    async def answer(self, caller: str, m: ExpertRequest) -> dict[str, Any]:
        """The reply to a parsed request, in its wire form."""
        await self._admit(caller, m)
        m = m.widened()
        served = self.served()
        if served is None:
            raise Refusal("bad", "this node holds no experts")
        run = served.run_of(m.layer, m.first)
        if run is None:
            raise Refusal(
                "bad", f"this node holds no experts of layer {m.layer} from expert {m.first} on"
            )
        worker = run.worker
        # ids count from the range start the caller saw advertised; ours may start lower
        rows, ids = worker.validate(m.layer, m.rows, m.ids.astype(np.int64) + m.first - run.first)
        out = await self._batched(worker, m.layer, rows, ids)
        return Outputs(out, self.wire_dtype).to_wire()

    def admitted(self, caller: str) -> bool:
        """Whether `caller` had a request admitted here lately (ADMITTED_S): the transport
        lets it send frames of any size (rpc.Intake)."""
        at = self._admitted.get(caller)
        return at is not None and self.clock() - at < ADMITTED_S

    async def _admit(self, caller: str, m: ExpertRequest) -> None:
        """Check every delegation the request carries, then have each gateway admitted for
        the expert units of its own rows (the count its stage keeps: experts.selections)."""
        if not m.groups:
            raise Refusal(
                "unpaid",
                "the request names no gateway (`for`): a worker computes "
                "rows only for gateways that delegated the caller, each "
                "with its signed delegation",
            )
        units: Counter[str] = Counter()
        at = 0
        for wire, rows in m.groups:
            gateway = self.delegations.check(wire, caller).gateway
            units[gateway] += selections(m.ids[at : at + rows])
            at += rows
        for gateway, n in units.items():
            await self.admit(gateway, n)
        now = self.clock()
        if len(self._admitted) > 1024:  # forget callers gone quiet
            self._admitted = {p: t for p, t in self._admitted.items() if now - t < ADMITTED_S}
        self._admitted[caller] = now

    async def _batched(
        self, worker: ExpertWorker, layer: int, rows: np.ndarray, ids: np.ndarray
    ) -> np.ndarray:
        key = (id(worker), layer)
        job = _Job(rows, ids)
        queue = self._queues.setdefault(key, [])
        queue.append(job)
        if len(queue) > 1:
            await job.done.wait()
        else:
            await self._lead(key, worker, layer)
        self.rows += len(rows)
        if job.error is not None:
            raise Refusal("bad", str(job.error))
        assert job.out is not None
        return job.out

    async def _lead(self, key: tuple[int, int], worker: ExpertWorker, layer: int) -> None:
        """Wait out the batching window, then compute every job queued for `key` at once."""
        batch: list[_Job] = []
        try:
            # Only wait for company when the last batch had some: a lone session pays nothing.
            await trio.sleep(self.window_s if self._last.get(key, 0) > 1 else 0)
            batch = self._queues.pop(key)
            self._last[key] = len(batch)
            short = sum(len(j.rows) for j in batch) <= INLINE_TOKENS
            outs = await run_short([worker], short, _run_batch, worker, layer, batch)
            for j, o in zip(batch, outs, strict=True):
                j.out = o
            self.calls += 1
        except ComputeError as exc:
            for j in batch:
                j.error = exc
        finally:
            # cancelled while waiting: the queued jobs must not wait for a leader forever
            batch = batch or self._queues.pop(key, [])
            for j in batch:
                if j.out is None and j.error is None:
                    j.error = ComputeError("the batch was cancelled")
                j.done.set()


@dataclass
class _Job:
    rows: np.ndarray
    ids: np.ndarray
    done: trio.Event = field(default_factory=trio.Event)
    out: np.ndarray | None = None
    error: Exception | None = None


def _run_batch(worker: ExpertWorker, layer: int, batch: list[_Job]) -> list[np.ndarray]:
    """One ggml call for every job: ids padded to the widest (repeating the first id)."""
    if len(batch) == 1:  # a lone call: nothing to pad (bench/bench_compute.py, per call)
        return [worker(layer, batch[0].rows, batch[0].ids)]
    width = max(j.ids.shape[1] for j in batch)
    ids = np.concatenate(
        [np.pad(j.ids, ((0, 0), (0, width - j.ids.shape[1])), mode="edge") for j in batch]
    )
    out = worker(layer, np.concatenate([j.rows for j in batch]), ids)
    outs, at = [], 0
    for j in batch:
        outs.append(out[at : at + len(j.rows), : j.ids.shape[1]])
        at += len(j.rows)
    return outs

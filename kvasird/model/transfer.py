"""The shard protocol: any peer holding verified pieces serves them; a node pulls a slice.

Transport-agnostic: it runs over any stream with ``async read(n)``, ``async write(data)``
and ``async close()`` (a libp2p stream on ``/kvasir/shard/1``, or trio memory streams in
tests). On one stream the client sends requests one after another, each a msgpack frame:

    ManifestAsk {"op": "manifest", "model": ID}        → header, then the manifest bytes
    ReadAsk {"op": "read", "model": ID, "ranges": [[tensor, expert, offset, length]...]}
                                                      → header, then the ranges' bytes, concatenated
    ProveAsk {"op": "prove", "model": ID, "nonce": BYTES, "ranges": [...]}
                                                      → header, then sha256(nonce ‖ ranges' bytes)
    Header {"ok": true, "len": N} | {"ok": false, "error": TEXT, "missing": [index...]}

Download (``download``): the wanted units' pieces that the store lacks are cut into
chunks (the manifest's verification grain, 4 MiB) and shared out to one worker per
holder, each asking for ~4 MiB per request with the next request already sent
(responses come back in request order). Every chunk is hashed against the manifest
before it is kept; a holder that sends wrong bytes is logged and dropped, a holder that
stalls or drops the stream is retried and then dropped, and its chunks go back to the
others. Chunks already on disk from an earlier, interrupted run are found by hashing
the partial files, so a download resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import trio

from kvasird.errors import KvasirError, ModelError, PeerError, WireError
from kvasird.model.manifest import MAX_MANIFEST, Manifest, ManifestError, Piece, Unit
from kvasird.model.progress import LogPacer, Meter, TerminalBar, mb_s
from kvasird.model.store import ShardStore, StoreError
from kvasird.wire import schema
from kvasird.wire.framing import ByteStream, FrameReader, write_frame
from kvasird.wire.protocols import OP

MAX_REQUEST_FRAME = 1 << 20
"""Largest request frame (a read request lists at most MAX_RANGES ranges)."""
MAX_RANGES = 4096
MAX_READ = 16 << 20
"""Most bytes one read request may ask for."""
NONCE_BYTES = (16, 64)
"""Length bounds of a proof request's nonce."""
BATCH_BYTES = 4 << 20
"""What a client asks one holder for per request."""
READ_SIZE = 1 << 20
"""Bytes asked of the stream per read call."""
MAX_SKIP = 1 << 16
"""Queue entries one take() looks past (pieces a holder lacks) before giving up."""
PIPELINE = 2
"""Requests a client keeps outstanding per stream, so the holder never waits for the next."""

log = structlog.get_logger("kvasird.model.transfer")


class TransferError(ModelError):
    """A download could not finish; what was verified so far stays on disk for a retry."""


class PeerMissing(PeerError):
    """A peer answered that it does not hold pieces it was asked for."""


class ShardStream(ByteStream, Protocol):
    async def close(self) -> None: ...


class ShardSource(Protocol):
    """What a server needs of local storage (ShardStore provides it). Called in a thread."""

    def manifest_bytes(self, model_id: str) -> bytes | None: ...

    def read_range(
        self, model_id: str, tensor: str, expert: int, offset: int, length: int
    ) -> bytes | None: ...


Peer = Hashable
OpenStream = Callable[[Any], Awaitable[ShardStream]]
"""Opens a new shard-protocol stream to a peer; raises if the peer cannot be reached."""


@dataclass(frozen=True)
class Progress:
    """A download's state, reported to the progress callback a few times a second."""

    done_bytes: int
    """Verified bytes on disk, counting what an earlier run left."""
    total_bytes: int
    """Bytes of all wanted pieces."""
    rate: float
    """Recent verified bytes per second."""
    eta_s: float | None
    """Seconds left at the recent rate; None before there is a rate."""
    holders: int
    """Holders still serving this download."""
    units: tuple[UnitProgress, ...] = ()
    """The same per wanted unit, in unit order."""

    @property
    def finished(self) -> bool:
        return self.done_bytes >= self.total_bytes


@dataclass(frozen=True)
class UnitProgress:
    """One unit's share of a download: the bytes this download fetches for it (a piece
    shared by several units counts for the first)."""

    unit: Unit
    """The unit."""
    done_bytes: int
    """Verified bytes on disk."""
    total_bytes: int
    """Bytes of its pieces."""
    rate: float
    """Recent verified bytes per second for this unit."""
    eta_s: float | None
    """Seconds left at its recent rate; 0.0 when done, None while it has no rate."""


@dataclass(frozen=True)
class TransferReport:
    """What a finished download did."""

    model_id: str
    """The model."""
    units: tuple[Unit, ...]
    """Units now held."""
    total_bytes: int
    """Bytes of all wanted pieces."""
    resumed_bytes: int
    """Bytes already present before this run (whole pieces or verified chunks)."""
    received_bytes: int
    """Payload bytes read from holders, including rejected ones."""
    rejected_bytes: int
    """Bytes that failed their hash check."""
    bad_holders: tuple[str, ...]
    """Holders caught serving wrong bytes."""
    seconds: float
    """Wall time of the download."""


ProgressCallback = Callable[[Progress], None]

Range = tuple[str, int, int, int]
"""(tensor, expert, offset, length): bytes of one piece."""


# messages


@dataclass(frozen=True)
class ManifestAsk:
    """Send me the manifest of this model."""

    model: str
    """The model id (the manifest's hash)."""

    def to_wire(self) -> dict[str, Any]:
        return {OP: "manifest", "model": self.model}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> ManifestAsk:
        return ManifestAsk(schema.text(d, "model", 128, "shard"))


@dataclass(frozen=True)
class ReadAsk:
    """Send me these bytes of a model's pieces."""

    model: str
    """The model id."""
    ranges: tuple[Range, ...]
    """1..MAX_RANGES ranges, at most MAX_READ bytes in all."""

    def to_wire(self) -> dict[str, Any]:
        return {OP: "read", "model": self.model, "ranges": [list(r) for r in self.ranges]}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> ReadAsk:
        return ReadAsk(schema.text(d, "model", 128, "shard"), _ranges(d.get("ranges")))


@dataclass(frozen=True)
class ProveAsk:
    """Prove you hold these bytes: answer sha256(nonce ‖ them) (proof_digest)."""

    model: str
    """The model id."""
    nonce: bytes
    """Fresh per question, NONCE_BYTES long, so the answer cannot be kept from before."""
    ranges: tuple[Range, ...]
    """As a read's."""

    def to_wire(self) -> dict[str, Any]:
        return {
            OP: "prove",
            "model": self.model,
            "nonce": self.nonce,
            "ranges": [list(r) for r in self.ranges],
        }

    @staticmethod
    def from_wire(d: dict[str, Any]) -> ProveAsk:
        nonce = d.get("nonce")
        if not isinstance(nonce, bytes) or not NONCE_BYTES[0] <= len(nonce) <= NONCE_BYTES[1]:
            raise WireError(
                f"shard.nonce: a proof request needs a nonce of "
                f"{NONCE_BYTES[0]}-{NONCE_BYTES[1]} bytes"
            )
        return ProveAsk(schema.text(d, "model", 128, "shard"), nonce, _ranges(d.get("ranges")))


ShardAsk = ManifestAsk | ReadAsk | ProveAsk
_ASKS: dict[str, Callable[[dict[str, Any]], ShardAsk]] = {
    "manifest": ManifestAsk.from_wire,
    "read": ReadAsk.from_wire,
    "prove": ProveAsk.from_wire,
}


def parse(value: Any) -> ShardAsk:
    """The request a decoded frame holds, validated (WireError naming the field)."""
    if not isinstance(value, dict):
        raise WireError("shard request: expected a map with an op and a model id")
    d: dict[str, Any] = value
    op = d.get(OP)
    parser = _ASKS.get(op) if isinstance(op, str) else None
    if parser is None:
        raise WireError(f"shard.{OP}: unknown op {op!r:.40}")
    return parser(d)


@dataclass(frozen=True)
class Header:
    """What comes before an answer's bytes: how many, or why there are none."""

    length: int
    """Bytes that follow (0 on a refusal)."""
    error: str = ""
    """Why the request was refused; "" when it was answered."""
    missing: tuple[int, ...] | None = None
    """On a refusal for pieces not held: the indexes of the ranges missing (a manifest
    not held: (0,)); None on any other refusal."""

    def to_wire(self) -> dict[str, Any]:
        if not self.error:
            return {"ok": True, "len": self.length}
        out: dict[str, Any] = {"ok": False, "error": self.error}
        if self.missing is not None:
            out["missing"] = list(self.missing)
        return out

    @staticmethod
    def from_wire(value: Any) -> Header:
        d = schema.mapping(value, "shard response header")
        if d.get("ok") is True:
            return Header(schema.integer(d, "len", 0, 1 << 62, "shard response header"))
        missing = d.get("missing")
        error = str(d.get("error"))[:200] or "refused"
        if isinstance(missing, list) and all(isinstance(i, int) for i in missing):
            return Header(0, error, tuple(missing))
        return Header(0, error)


# server


async def serve_shards(
    stream: ShardStream, source: ShardSource, idle_timeout: float = 120.0
) -> None:
    """Answer requests on one stream until the peer closes it, breaks the protocol or stays
    idle for idle_timeout; then close the stream. Mount it as the stream handler:
    ``host.set_stream_handler(PROTOCOL_ID, lambda s: serve_shards(s, store))``."""
    reader = FrameReader(stream, MAX_REQUEST_FRAME)
    try:
        while True:
            with trio.move_on_after(idle_timeout) as idle:
                request = await reader.read()
            if idle.cancelled_caught:
                return
            try:
                header, body = await trio.to_thread.run_sync(_answer, source, request)
            except KvasirError as exc:
                header, body = Header(0, str(exc)).to_wire(), []
            await write_frame(stream, header)
            for part in body:
                await stream.write(part)
    except Exception as exc:  # noqa: BLE001 - the peer went away or broke the protocol
        log.debug("shard stream ended", error=repr(exc))
    finally:
        await _close(stream)


def _answer(source: ShardSource, value: Any) -> tuple[dict[str, Any], list[bytes]]:
    """The answer to a decoded request frame: its header's wire form, then its bytes."""
    request = parse(value)
    if isinstance(request, ManifestAsk):
        raw = source.manifest_bytes(request.model)
        if raw is None:
            return Header(0, "unknown model", (0,)).to_wire(), []
        return Header(len(raw)).to_wire(), [raw]
    parts = [source.read_range(request.model, *r) for r in request.ranges]
    held = [p for p in parts if p is not None]
    if len(held) < len(parts):
        missing = tuple(i for i, p in enumerate(parts) if p is None)
        return Header(0, "pieces not held here", missing).to_wire(), []
    if isinstance(request, ProveAsk):
        return Header(32).to_wire(), [proof_digest(request.nonce, held)]
    return Header(sum(len(p) for p in held)).to_wire(), held


def proof_digest(nonce: bytes, parts: Iterable[bytes]) -> bytes:
    """What a holder answers to a proof request: sha256 of the nonce and the bytes asked for.
    A fresh nonce makes it unanswerable without the bytes themselves."""
    h = hashlib.sha256(nonce)
    for part in parts:
        h.update(part)
    return h.digest()


def _ranges(value: Any) -> tuple[Range, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_RANGES:
        raise WireError(f"shard.ranges: a request needs 1..{MAX_RANGES} ranges")
    out = []
    for r in value:
        if (
            not isinstance(r, list)
            or len(r) != 4
            or not isinstance(r[0], str)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in r[1:])
            or r[2] < 0
            or r[3] < 0
        ):
            raise WireError("shard.ranges: each range is [tensor, expert, offset, length]")
        out.append((r[0], r[1], r[2], r[3]))
    if sum(r[3] for r in out) > MAX_READ:
        raise WireError(f"shard.ranges: a request asks for more than {MAX_READ} bytes")
    return tuple(out)


# client


async def ask(
    open_stream: OpenStream,
    peer: Peer,
    request: ReadAsk | ProveAsk,
    max_len: int,
    stall_timeout: float,
) -> bytes:
    """One request on a stream of its own, and its answer's bytes. Raises PeerMissing when
    the holder says it lacks a piece asked for; other errors as they come (a transport
    failure, WireError for a malformed answer, trio.TooSlowError past stall_timeout)."""
    stream = await open_stream(peer)
    try:
        with trio.fail_after(stall_timeout):
            await write_frame(stream, request.to_wire())
            return bytes(await _response(stream, max_len))
    except _Missing:
        raise PeerMissing(f"{str(peer)[:16]} lacks pieces it was asked for") from None
    finally:
        await _close(stream)


async def fetch_manifest(
    open_stream: OpenStream, holders: Sequence[Peer], model_id: str, stall_timeout: float = 30.0
) -> Manifest:
    """The manifest of model_id from the first holder that sends bytes hashing to it."""
    for peer in holders:
        try:
            stream = await open_stream(peer)
            try:
                with trio.fail_after(stall_timeout):
                    await write_frame(stream, ManifestAsk(model_id).to_wire())
                    raw = await _response(stream, MAX_MANIFEST)
            finally:
                await _close(stream)
            return Manifest.from_bytes(raw, model_id)
        except ManifestError as exc:
            log.warning("holder sent a bad manifest", peer=str(peer), error=str(exc))
        except (Exception, trio.TooSlowError) as exc:  # noqa: BLE001 - any transport failure
            log.info("holder could not send the manifest", peer=str(peer), error=repr(exc))
    raise TransferError(
        f"no holder sent the manifest of {model_id[:16]}: "
        "check that the holders are online and hold this model"
    )


async def ensure_manifest(
    store: ShardStore,
    model_id: str,
    holders: Sequence[Peer],
    open_stream: OpenStream,
    stall_timeout: float = 30.0,
) -> Manifest:
    """The model's manifest from the store, else fetched from a holder and stored."""
    try:
        return store.manifest(model_id)
    except StoreError:
        manifest = await fetch_manifest(open_stream, holders, model_id, stall_timeout)
        store.add_manifest(manifest, source="peer")
        return manifest


async def download(
    store: ShardStore,
    model_id: str,
    units: Iterable[Unit] | None,
    holders: Sequence[Peer],
    open_stream: OpenStream,
    *,
    progress: ProgressCallback | None = None,
    stall_timeout: float = 30.0,
    retries: int = 2,
    batch_bytes: int = BATCH_BYTES,
) -> TransferReport:
    """Obtain `units` of a model (all when None) from `holders` into the store.

    The manifest comes from the store, else from the first holder whose copy hashes to
    model_id. The units are recorded as pending first (gc keeps their partial pieces)
    and as held once every piece is in. On TransferError they stay pending: call again
    with other holders to resume, or ``store.drop(model_id, units)`` to give up.
    `progress` is called about 4 times a second and once at the end; a terminal shows a
    bar, and the log gets a "shard download progress" event every 5 s or 10 %.
    """
    start = trio.current_time()
    manifest = await ensure_manifest(store, model_id, holders, open_stream, stall_timeout)
    wanted = list(manifest.unit_sizes) if units is None else list(units)
    unknown = [u for u in wanted if u not in manifest.unit_sizes]
    if unknown:
        raise TransferError(f"model {model_id[:16]} has no unit {unknown[0]}")
    store.begin(model_id, wanted)
    work = await trio.to_thread.run_sync(_plan, store, manifest, wanted)
    job = _Job(store, manifest, work, progress, start, len(holders))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(job.report_progress)
        async with trio.open_nursery() as workers:
            for peer in holders:
                workers.start_soon(
                    _Holder(job, peer, open_stream, stall_timeout, retries, batch_bytes).run
                )
        nursery.cancel_scope.cancel()
    if any(job.left.values()):
        raise TransferError(
            f"download of {model_id[:16]} stopped with {job.total - job.done:,} bytes missing: "
            f"no holder left (bad: {', '.join(job.bad) or 'none'}); verified pieces are kept, "
            "run it again with other holders to resume"
        )
    store.mark_held(model_id, wanted)
    report = TransferReport(
        model_id,
        tuple(wanted),
        job.total,
        job.resumed,
        job.received,
        job.rejected,
        tuple(job.bad),
        trio.current_time() - start,
    )
    log.info(
        "shard download finished",
        model=model_id[:16],
        units=len(wanted),
        bytes=report.total_bytes,
        received=report.received_bytes,
        resumed=report.resumed_bytes,
        bad_holders=list(report.bad_holders),
        seconds=round(report.seconds, 3),
    )
    return report


@dataclass(frozen=True)
class _Chunk:
    piece: Piece
    """The piece it belongs to."""
    offset: int
    """Offset within the piece."""
    length: int
    """Bytes."""
    sha256: bytes
    """Expected hash (the piece's own for a one-chunk piece)."""


@dataclass
class _Work:
    chunks: list[_Chunk]
    total: int
    resumed: int
    left: dict[bytes, int] = field(default_factory=dict)
    unit_total: dict[Unit, int] = field(default_factory=dict)
    unit_done: dict[Unit, int] = field(default_factory=dict)


def _plan(store: ShardStore, manifest: Manifest, units: list[Unit]) -> _Work:
    """Chunks still to fetch; done chunks of earlier runs are found by hashing partial files.

    A piece already in the store is checked against its hash first (once per file
    version): a corrupt blob is deleted and fetched again.
    """
    chunks, seen, total, resumed, left = [], set(), 0, 0, {}
    unit_total: dict[Unit, int] = dict.fromkeys(units, 0)
    unit_done: dict[Unit, int] = {}
    for piece in manifest.pieces(units):
        if piece.sha256 in seen:
            continue
        seen.add(piece.sha256)
        total += piece.length
        unit_total[piece.unit] += piece.length
        if store.check_piece(piece):
            resumed += piece.length
            unit_done[piece.unit] = unit_done.get(piece.unit, 0) + piece.length
            continue
        spans = piece.spans(manifest.chunk_size)
        done = store.resume_point(piece, manifest.chunk_size) if len(spans) > 1 else set()
        todo = [
            _Chunk(piece, off, n, sha) for i, (off, n, sha) in enumerate(spans) if i not in done
        ]
        resumed += piece.length - sum(c.length for c in todo)
        unit_done[piece.unit] = (
            unit_done.get(piece.unit, 0) + piece.length - sum(c.length for c in todo)
        )
        if todo:
            left[piece.sha256] = len(todo)
            chunks += todo
        else:
            store.finish_piece(piece)
    return _Work(chunks, total, resumed, left, unit_total, unit_done)


class _Job:
    """Shared state of one download: the queue of chunks and the counters."""

    def __init__(
        self,
        store: ShardStore,
        manifest: Manifest,
        work: _Work,
        progress: ProgressCallback | None,
        start: float,
        n_holders: int,
    ) -> None:
        self.store, self.manifest = store, manifest
        self.pending: deque[_Chunk] = deque(work.chunks)
        self.left = work.left
        self.total, self.resumed = work.total, work.resumed
        self.done = work.resumed
        self.received = self.rejected = self.in_flight = 0
        self.bad: list[str] = []
        self.active = n_holders
        self.refused: dict[Peer, set[tuple[bytes, int]]] = {}
        self._changed = trio.Event()
        self._progress = progress
        self.meter = Meter(self.total, self.done, start)
        self.units = {
            u: Meter(n, work.unit_done.get(u, 0), start) for u, n in sorted(work.unit_total.items())
        }
        self._unit_done = dict(work.unit_done)
        self._pacer = LogPacer(start)
        self._bar = TerminalBar(f"shards {manifest.model_id[:8]}", self.total)

    def take(self, peer: Peer, max_bytes: int) -> list[_Chunk]:
        """The next chunks in file order, up to max_bytes (at least one), skipping those
        this peer said it lacks; queue order is kept."""
        refused = self.refused.get(peer, set())
        batch: list[_Chunk] = []
        skipped: list[_Chunk] = []
        size = 0
        while self.pending and len(skipped) < MAX_SKIP:
            c = self.pending.popleft()
            if (c.sha256, c.offset) in refused:
                skipped.append(c)
                continue
            if batch and size + c.length > max_bytes:
                skipped.append(c)
                break
            batch.append(c)
            size += c.length
            if size >= max_bytes:
                break
        self.pending.extendleft(reversed(skipped))
        self.in_flight += len(batch)
        return batch

    def give_back(self, chunks: Iterable[_Chunk]) -> None:
        chunks = list(chunks)
        self.pending.extendleft(reversed(chunks))
        self.in_flight -= len(chunks)
        self._changed.set()

    def completed(self, chunk: _Chunk) -> bool:
        """Count a verified chunk; True when its piece is now complete on disk."""
        self.in_flight -= 1
        self.done += chunk.length
        unit = chunk.piece.unit
        self._unit_done[unit] = self._unit_done.get(unit, 0) + chunk.length
        self.left[chunk.piece.sha256] -= 1
        self._changed.set()
        return (
            self.left[chunk.piece.sha256] == 0
            and len(chunk.piece.spans(self.manifest.chunk_size)) > 1
        )

    async def changed(self) -> None:
        event = self._changed
        await event.wait()
        if self._changed is event:
            self._changed = trio.Event()

    def holder_gone(self) -> None:
        self.active -= 1
        self._changed.set()

    def emit(self) -> None:
        """Measure now; tell the callback, the terminal bar and (when due) the log."""
        now = trio.current_time()
        self.meter.update(self.done, now)
        for u, meter in self.units.items():
            meter.update(self._unit_done.get(u, 0), now)
        p = Progress(
            self.done,
            self.total,
            self.meter.rate,
            self.meter.eta_s,
            self.active,
            tuple(UnitProgress(u, m.done, m.total, m.rate, m.eta_s) for u, m in self.units.items()),
        )
        if self._progress is not None:
            self._progress(p)
        self._bar.show(self.meter)
        if self._pacer.due(self.meter.fraction, now):
            self._log(p)

    def _log(self, p: Progress) -> None:
        busy = [u for u in p.units if 0 < u.done_bytes < u.total_bytes] or [
            u for u in p.units if u.done_bytes < u.total_bytes
        ][:1]
        log.info(
            "shard download progress",
            model=self.manifest.model_id[:16],
            unit=",".join(str(u.unit) for u in busy) or "-",
            units_done=sum(u.done_bytes >= u.total_bytes for u in p.units),
            units=len(p.units),
            bytes=p.done_bytes,
            total=p.total_bytes,
            pct=round(100 * self.meter.fraction, 1),
            mb_s=mb_s(p.rate),
            eta_s=None if p.eta_s is None else round(p.eta_s, 1),
            holders=p.holders,
        )

    async def report_progress(self) -> None:
        with self._bar:
            try:
                while True:
                    self.emit()
                    await trio.sleep(0.25)
            finally:
                self.emit()


class _Holder:
    """One holder's worker: requests batches of chunks until none is left for it."""

    def __init__(
        self,
        job: _Job,
        peer: Peer,
        open_stream: OpenStream,
        stall_timeout: float,
        retries: int,
        batch_bytes: int,
    ) -> None:
        self.job, self.peer, self.open_stream = job, peer, open_stream
        self.stall, self.retries, self.batch_bytes = stall_timeout, retries, batch_bytes
        self.lying = False

    async def run(self) -> None:
        failures = 0
        try:
            while failures <= self.retries and self._has_work():
                try:
                    if await self._session():
                        return
                    failures = 0
                except _BadBytes:
                    return
                except (Exception, trio.TooSlowError) as exc:  # noqa: BLE001 - transport failure
                    failures += 1
                    log.info(
                        "shard holder failed",
                        peer=str(self.peer),
                        error=repr(exc),
                        attempt=failures,
                    )
                    await trio.sleep(0.2 * failures)
        finally:
            self.job.holder_gone()

    def _has_work(self) -> bool:
        return bool(self.job.pending or self.job.in_flight)

    async def _session(self) -> bool:
        """Fetch batches over one stream; True when this holder has nothing left to do.

        While one batch is hashed and written in a worker thread the next is already
        on the wire, so neither the network nor the disk waits for the other.
        """
        with trio.fail_after(self.stall):
            stream = await self.open_stream(self.peer)
        done = False
        try:
            async with trio.open_nursery() as keepers:
                done = await self._pump(stream, keepers)
            if self.lying:
                raise _BadBytes()
            return done
        finally:
            await _close(stream)

    async def _pump(self, stream: ShardStream, keepers: trio.Nursery) -> bool:
        slot = trio.Semaphore(1)
        sent: deque[list[_Chunk]] = deque()
        try:
            while True:
                while len(sent) < PIPELINE and (
                    batch := self.job.take(self.peer, self.batch_bytes)
                ):
                    sent.append(batch)
                    await self._send(stream, batch)
                if not sent:
                    if not self.job.in_flight:
                        return True  # nothing left, or nothing this holder has
                    await self.job.changed()
                    continue
                data = await self._receive(stream, sent[0])
                if data is None:
                    self.job.give_back(sent.popleft())
                    continue
                await slot.acquire()
                keepers.start_soon(self._keep, sent.popleft(), data, slot, keepers.cancel_scope)
        except BaseException:
            for batch in sent:
                self.job.give_back(batch)
            raise

    async def _send(self, stream: ShardStream, batch: list[_Chunk]) -> None:
        ranges = tuple((c.piece.tensor, c.piece.expert, c.offset, c.length) for c in batch)
        with trio.fail_after(self.stall):
            await write_frame(
                stream, ReadAsk(self.job.manifest.model_id, ranges).to_wire(), MAX_REQUEST_FRAME
            )

    async def _receive(self, stream: ShardStream, batch: list[_Chunk]) -> bytearray | None:
        """The bytes of a batch; None if the holder lacks some of it (noted, not retried)."""
        expected = sum(c.length for c in batch)
        try:
            data = await _response(stream, expected, self.stall)
        except _Missing as missing:
            refused = self.job.refused.setdefault(self.peer, set())
            refused.update(
                (batch[i].sha256, batch[i].offset) for i in missing.indexes if 0 <= i < len(batch)
            )
            log.debug(
                "holder lacks pieces; asking others",
                peer=str(self.peer),
                pieces=len(missing.indexes),
            )
            return None
        self.job.received += len(data)
        if len(data) != expected:
            raise WireError(f"holder sent {len(data)} bytes for a request of {expected}")
        return data

    async def _keep(
        self, batch: list[_Chunk], data: bytearray, slot: trio.Semaphore, session: trio.CancelScope
    ) -> None:
        """Verify and store a batch; a wrong chunk ends this holder's session for good."""
        with trio.CancelScope(shield=True):
            good = await trio.to_thread.run_sync(self._check_and_write, batch, data)
            bad = [c for c, ok in zip(batch, good, strict=True) if not ok]
            for c, ok in zip(batch, good, strict=True):
                if ok and self.job.completed(c):
                    await trio.to_thread.run_sync(self.job.store.finish_piece, c.piece)
            slot.release()
        if bad:
            self.job.rejected += sum(c.length for c in bad)
            self.job.give_back(bad)
            if not self.lying:
                self.lying = True
                self.job.bad.append(str(self.peer))
                log.warning(
                    "shard holder sent wrong bytes; not using it again",
                    peer=str(self.peer),
                    model=self.job.manifest.model_id[:16],
                    tensor=bad[0].piece.tensor,
                    expert=bad[0].piece.expert,
                    bad_chunks=len(bad),
                )
            session.cancel()

    def _check_and_write(self, batch: list[_Chunk], data: bytearray) -> list[bool]:
        view, pos, out = memoryview(data), 0, []
        for c in batch:
            out.append(
                self.job.store.accept_chunk(c.piece, c.offset, view[pos : pos + c.length], c.sha256)
            )
            pos += c.length
        return out


class _BadBytes(Exception):
    """This holder sent bytes that do not match the manifest."""


class _Missing(PeerError):
    def __init__(self, indexes: list[int]) -> None:
        super().__init__("holder lacks some requested pieces")
        self.indexes = indexes


async def _response(stream: ByteStream, max_len: int, stall: float | None = None) -> bytearray:
    """Read one response: its header frame, then exactly the announced bytes."""
    reader = FrameReader(stream, MAX_REQUEST_FRAME)
    with trio.fail_after(stall if stall is not None else math.inf):
        header = Header.from_wire(await reader.read())
    if header.error:
        if header.missing is not None:
            raise _Missing(list(header.missing))
        raise PeerError(f"holder refused: {header.error}")
    length = header.length
    if length > max_len:
        raise WireError(f"shard response of {length!r} bytes, expected at most {max_len}")
    buf = bytearray(length)
    view, got = memoryview(buf), 0
    while got < length:
        with trio.fail_after(stall if stall is not None else math.inf):
            part = await stream.read(min(READ_SIZE, length - got))
        if not part:
            raise WireError(f"holder closed the stream after {got} of {length} bytes")
        view[got : got + len(part)] = part
        got += len(part)
    return buf


async def _close(stream: ShardStream) -> None:
    # closing a broken stream may fail; there is nothing left to do about it then
    with (
        trio.CancelScope(deadline=trio.current_time() + 1, shield=True),
        contextlib.suppress(Exception),
    ):
        await stream.close()

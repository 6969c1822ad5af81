"""ShardService: this node's shard store on the network.

Serves pieces of every model in the store over /kvasir/shard/1 (a few streams at once),
downloads the units the market enrolled this node into from the peers that hold them,
and resolves the configured model (a GGUF path, ``bundled:NAME``, or a model id that
peers announce) into a manifest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from kvasird.logs import get_logger
from kvasird.model.manifest import Manifest, Unit
from kvasird.model.progress import mb_s
from kvasird.model.ref import ModelRef
from kvasird.model.slice import contiguous_runs, parse_spec
from kvasird.model.store import AmbiguousName, ShardStore, StoreError
from kvasird.model.transfer import (
    Progress,
    ShardSource,
    TransferReport,
    download,
    ensure_manifest,
    serve_shards,
)
from kvasird.p2p import P2PNode
from kvasird.wire.protocols import SHARD_PROTOCOL

log = get_logger("kvasird.shards")

SLICE_GRACE_S = 120.0
"""An expert slice assembled this recently is not pruned: a hot expert's may be loading."""

MAX_SERVING_STREAMS = 4
OPEN_TIMEOUT_S = 10.0


class ShardService:
    def __init__(
        self, p2p: P2PNode, store: ShardStore, *, source: ShardSource | None = None
    ) -> None:
        self.p2p = p2p
        self.store = store
        self.source: ShardSource = store if source is None else source
        """What serving reads pieces from: the store (a test's fault layer passes a wrapper
        of it: a slow holder, a lying one)."""
        self._serving = trio.CapacityLimiter(MAX_SERVING_STREAMS)
        self.last_report: TransferReport | None = None
        self.progress: Progress | None = None
        """The running (or else the last) download: bytes done and total, rate and ETA,
        overall and per unit; updated about 4 times a second. ``view()["progress"]`` is
        the same as JSON."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.p2p.host.set_stream_handler(SHARD_PROTOCOL, self._serve)
        task_status.started()
        await trio.sleep_forever()

    async def _serve(self, stream: Any) -> None:
        async with self._serving:
            await serve_shards(stream, self.source)

    async def open_stream(self, peer: str) -> Any:
        with trio.fail_after(OPEN_TIMEOUT_S):
            return await self.p2p.host.new_stream(ID.from_base58(peer), [SHARD_PROTOCOL])

    async def resolve(
        self,
        text: str,
        announcers: Callable[[str], list[str]],
        named: Callable[[str], list[str]] = lambda text: [],
    ) -> Manifest:
        """The manifest of the configured model, importing or fetching it as needed.
        ``named(text)``: the ids of the models peers announce under that name."""
        ref = ModelRef.parse(text, where="market.model")
        if ref.from_peers:
            model_id = ref.value if ref.kind == "id" else await self._named(ref.value, named)
            while True:
                try:
                    return self.store.manifest(model_id)
                except Exception:  # noqa: BLE001 - not in the store yet
                    pass
                peers = announcers(model_id)
                if peers:
                    try:
                        return await ensure_manifest(self.store, model_id, peers, self.open_stream)
                    except Exception as exc:  # noqa: BLE001 - try again with whoever announces it
                        log.warning(
                            "fetching the model manifest failed",
                            model=model_id[:16],
                            error=str(exc)[:200],
                        )
                await trio.sleep(1.0)
        log.info("importing model into the shard store", model=str(ref))
        manifest = await trio.to_thread.run_sync(self.store.add, ref)
        log.info("model imported", model_id=manifest.model_id, bytes=manifest.total_bytes)
        return manifest

    async def _named(self, name: str, named: Callable[[str], list[str]]) -> str:
        """The id of the model ``name`` names: one this node knows by that name, else the
        one its peers' records name so (waited for: a node holding nothing learns the id
        from them). A name two models claim is refused with both ids."""
        waiting = False
        while True:
            try:
                return self.store.resolve(name)
            except AmbiguousName:
                raise
            except StoreError:
                pass
            ids = named(name)
            if len(ids) > 1:
                raise AmbiguousName(
                    f"[market] model = {name!r} names {len(ids)} models the "
                    f"network serves: {', '.join(ids)}: set it to the model "
                    "id of the one to serve"
                )
            if ids:
                return ids[0]
            if not waiting:
                log.info("waiting for a peer's record naming the model", model=name)
                waiting = True
            await trio.sleep(1.0)

    def has_all(self, model_id: str) -> bool:
        """Whether this node holds every byte of the model (it can seed any unit)."""
        try:
            return set(self.store.held_units(model_id)) >= set(
                self.store.manifest(model_id).unit_sizes
            )
        except Exception:  # noqa: BLE001 - unknown model
            return False

    async def fetch(
        self, model_id: str, units: Iterable[Unit], holders: list[str]
    ) -> TransferReport | None:
        """Download the units not yet on disk, or no longer intact there, from ``holders``;
        None when nothing was missing."""
        units = list(units)
        held = set(await trio.to_thread.run_sync(self.store.verified_held, model_id, units))
        missing = [u for u in units if u not in held]
        if not missing:
            return None
        report = await download(
            self.store, model_id, missing, holders, self.open_stream, progress=self._progress
        )
        self.last_report = report
        log.info(
            "units downloaded",
            model=model_id[:16],
            units=len(report.units),
            bytes=report.total_bytes,
            received=report.received_bytes,
            resumed=report.resumed_bytes,
            bad_holders=list(report.bad_holders),
            seconds=round(report.seconds, 2),
        )
        return report

    def model_files(self, model_id: str, units: Iterable[Unit]) -> list[Path]:
        """GGUF files holding ``units`` for the compute engine.

        The imported original when it is still on disk (no copy), else mini-GGUF slices
        assembled from the verified pieces in the store (written once, reused while they
        still match the manifest: a damaged one is assembled again). Reads files: call
        it in a worker thread.
        """
        record = next((m for m in self.store.models() if m.model_id == model_id), None)
        if record and record.source and Path(record.source).is_file() and self.has_all(model_id):
            return [Path(record.source)]
        folder = self.store.root.parent / "slices" / model_id
        folder.mkdir(parents=True, exist_ok=True)
        out = []
        for text in slice_specs(units):
            path, spec = folder / _slice_name(text), parse_spec(text)
            if not self.store.check_slice(model_id, spec, path):
                self.store.write_slice(model_id, spec, path)
            out.append(path)
        return out

    def prune(self, model_id: str, keep: Iterable[Unit], budget: int) -> int:
        """Keep a downloaded model's share of the disk within ``budget``: once the units held
        in the store pass it, every unit not in ``keep`` (those the market holds) is
        dropped, and every assembled slice the engine no longer loads is deleted. A model
        imported here (``kvasird model add``) is the owner's whole copy and is kept.
        Returns bytes freed. Reads and deletes files: call it in a worker thread."""
        record = next((m for m in self.store.models() if m.model_id == model_id), None)
        if record is None or record.source != "peer":
            return 0
        keep = set(keep)
        sizes = self.store.manifest(model_id).unit_sizes
        held = set(self.store.held_units(model_id))
        freed = 0
        if sum(sizes[u] for u in held) > budget and held - keep:
            freed = self.store.drop(model_id, sorted(held - keep))
        folder = self.store.root.parent / "slices" / model_id
        used = {_slice_name(text) for text in slice_specs(keep)}
        recent = time.time() - SLICE_GRACE_S
        for path in folder.glob("*.gguf") if folder.is_dir() else ():
            hot = path.name.startswith("experts")  # perhaps a hot expert's, loading now
            if path.name not in used and not (hot and path.stat().st_mtime >= recent):
                freed += path.stat().st_size
                path.unlink(missing_ok=True)
        if freed:
            log.info(
                "store pruned to the budget",
                model=model_id[:16],
                freed_bytes=freed,
                kept_units=len(keep),
            )
        return freed

    def _progress(self, p: Progress) -> None:
        self.progress = p

    def view(self) -> dict[str, Any]:
        r, p = self.last_report, self.progress
        return {
            "models": [
                {
                    "model_id": m.model_id,
                    "name": m.name,
                    "held_bytes": m.held_bytes,
                    "total_bytes": m.total_bytes,
                }
                for m in self.store.models()
            ],
            "progress": None if p is None else progress_view(p),
            "last_download": None
            if r is None
            else {
                "units": len(r.units),
                "total_bytes": r.total_bytes,
                "received_bytes": r.received_bytes,
                "resumed_bytes": r.resumed_bytes,
                "rejected_bytes": r.rejected_bytes,
                "bad_holders": list(r.bad_holders),
                "seconds": r.seconds,
            },
        }


def slice_specs(units: Iterable[Unit]) -> list[str]:
    """The fewest slice specs covering ``units``: layer runs (dense paths), expert runs, head."""
    layers = sorted(u.layer for u in units if u.kind == "layer")
    experts = sorted((u.layer, u.expert) for u in units if u.kind == "expert")
    specs = ["head"] if any(u.kind == "head" for u in units) else []
    for a, b in contiguous_runs(layers):
        specs.append(f"layers={a}:{b},no-experts")
    by_layer: dict[int, list[int]] = {}
    for layer, e in experts:
        by_layer.setdefault(layer, []).append(e)
    for layer, es in sorted(by_layer.items()):
        specs += [f"experts={layer}:{a}:{b}" for a, b in contiguous_runs(es)]
    return specs


def _slice_name(spec: str) -> str:
    """The file an assembled slice is kept in, under slices/<model id>/."""
    return spec.replace("=", "-").replace(":", "_").replace(",", "+") + ".gguf"


def progress_view(p: Progress) -> dict[str, Any]:
    """A download's progress as JSON: overall and per unit (rates in bytes/s and MB/s)."""
    return {
        "done_bytes": p.done_bytes,
        "total_bytes": p.total_bytes,
        "rate": p.rate,
        "mb_s": mb_s(p.rate),
        "eta_s": p.eta_s,
        "holders": p.holders,
        "finished": p.finished,
        "units": [
            {
                "unit": str(u.unit),
                "done_bytes": u.done_bytes,
                "total_bytes": u.total_bytes,
                "mb_s": mb_s(u.rate),
                "eta_s": u.eta_s,
            }
            for u in p.units
        ],
    }

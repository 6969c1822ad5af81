"""The shard store: verified model pieces on disk, content-addressed, and which units we hold.

    <home>/shards/manifests/<model id>.msgpack   canonical manifest bytes (hash = model id)
    <home>/shards/blobs/<ab>/<sha256>            one piece (a tensor or an expert slab)
    <home>/shards/partial/<sha256>.part          a multi-chunk piece being downloaded
    state.db  shard_models, shard_names, shard_units, shard_refs

Every byte enters through ``put_piece`` or ``accept_chunk``, which hash it against the
manifest before it lands (verified on write); ``read_piece`` hashes again (verified on
load). Blobs and assembled slices that are reused (served, resumed, loaded again after a
restart) are checked against the manifest too, hashed once per version of the file:
``shard_verified`` remembers, with what the file should hold (a piece's hash, a model's
slice), the (size, mtime_ns, inode) it had when it last hashed right, so a restart costs
a stat per file, not a rehash. A blob that went bad is deleted and every unit needing it
goes back to *pending* (no longer held, so ``has_all`` and the shard records stop
counting it) until it is downloaded again.

A unit is *pending* while it downloads and *held* once all its pieces are in; both
protect its blobs from ``gc``, which deletes blobs no unit refers to once a unit or
model is dropped. Identical pieces (e.g. equal norm vectors) are stored once.

SQLite is used from one thread (the trio thread); the file and hashing methods
(``accept_chunk``, ``read_range``, ``read_piece``...) are safe to run in worker threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvasird import db
from kvasird.errors import ModelError
from kvasird.home import Home
from kvasird.logs import get_logger
from kvasird.model.manifest import Manifest, ManifestError, Piece, Unit
from kvasird.model.names import NAME, model_name, named_by
from kvasird.model.ref import FORMS, ModelRef
from kvasird.model.slice import SliceSpec, gguf_pieces, units_of, verify_slice, write_slice

_SCHEMA = """
CREATE TABLE IF NOT EXISTS shard_models (
    model_id TEXT PRIMARY KEY, name TEXT NOT NULL, arch TEXT NOT NULL,
    total_bytes INTEGER NOT NULL, source TEXT NOT NULL, added_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS shard_names (
    model_id TEXT NOT NULL, name TEXT NOT NULL, PRIMARY KEY (model_id, name));
CREATE TABLE IF NOT EXISTS shard_units (
    model_id TEXT NOT NULL, unit TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('pending', 'held')),
    PRIMARY KEY (model_id, unit));
CREATE TABLE IF NOT EXISTS shard_refs (
    model_id TEXT NOT NULL, unit TEXT NOT NULL, sha256 BLOB NOT NULL,
    PRIMARY KEY (model_id, unit, sha256));
CREATE INDEX IF NOT EXISTS shard_refs_by_sha ON shard_refs (sha256);
CREATE TABLE IF NOT EXISTS shard_verified (
    path TEXT PRIMARY KEY, content TEXT NOT NULL,
    size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, inode INTEGER NOT NULL);
"""


log = get_logger("kvasird.shards")

ImportProgress = Callable[[str, int, int], None]
"""Called with (phase, done bytes, total bytes) while a GGUF is imported."""


class StoreError(ModelError):
    """The shard store cannot do what was asked (unknown model, missing or corrupt piece)."""


class AmbiguousName(StoreError):
    """A name, slug or id prefix that names more than one model: the message lists their
    ids, and the full id names the one meant."""


class CorruptPiece(StoreError):
    """Stored bytes no longer match their hash; the blob has been deleted."""


@dataclass(frozen=True)
class ModelRecord:
    """A model the store knows, with how much of it we hold."""

    model_id: str
    """sha256 of the manifest."""
    name: str
    """Its name, ``family:tag`` (`kvasird model add --name`, else model.names.model_name of
    its metadata and file name, or for a model fetched from peers the name they give it)."""
    arch: str
    """GGUF architecture, e.g. llama, qwen3moe."""
    total_bytes: int
    """Tensor bytes of the whole model."""
    held_bytes: int
    """Tensor bytes of the units held here."""
    held_units: int
    """Number of units held."""
    source: str
    """Where it came from: a path, bundled:NAME, or peer."""


class ShardStore:
    """The store under one home; use as a context manager or call close()."""

    def __init__(self, root: Path, db_path: Path) -> None:
        self.root = root
        for sub in ("manifests", "blobs", "partial"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._db = db.connect(db_path)
        db.ensure_schema(self._db, _SCHEMA)
        self._manifests: dict[str, Manifest] = {}
        self._lock = threading.Lock()
        """Serialises this store's writes from worker threads (downloads, slice loads)."""

    @classmethod
    def open(cls, home: Home) -> ShardStore:
        return cls(home.shards, home.db)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # models

    def add_manifest(
        self, manifest: Manifest, name: str = "", source: str = "peer", default: str = ""
    ) -> None:
        """Know ``manifest``'s model, listed as ``name`` (it replaces the name it had), or,
        for a model new here, ``default`` or the name of its metadata (``model_name``).
        A name from before names were ``family:tag`` ("SmolLM2 135M Instruct") is
        replaced the same way: peers refuse such a name in a record."""
        path = self._manifest_path(manifest.model_id)
        if not path.exists():
            _write_atomic(path, manifest.raw)
        self._manifests[manifest.model_id] = manifest
        shown = name or default or model_name({k: v for k, _, v in manifest.metadata})
        old = self.name_of(manifest.model_id)
        with self._db:
            self._db.execute(
                "INSERT OR IGNORE INTO shard_models VALUES (?, ?, ?, ?, ?, ?)",
                (
                    manifest.model_id,
                    shown,
                    manifest.arch,
                    manifest.total_bytes,
                    source,
                    time.time(),
                ),
            )
        if old is None or name or not NAME.fullmatch(old):
            self._list_as(manifest.model_id, shown)

    def adopt_name(self, model_id: str, name: str) -> None:
        """List a model fetched from peers under the name the network gives it
        (``names.agreed_name``); a model imported here keeps the name chosen for it."""
        if not self.name_claim(model_id)[1]:
            self._list_as(model_id, name)

    def _list_as(self, model_id: str, name: str) -> None:
        """The model's name is ``name`` now; the names it had still find it (``resolve``):
        a node configured by a name starts again after the network renamed its model."""
        with self._db:
            self._db.execute(
                "UPDATE shard_models SET name = ? WHERE model_id = ?", (name, model_id)
            )
            self._db.execute("INSERT OR IGNORE INTO shard_names VALUES (?, ?)", (model_id, name))

    def name_claim(self, model_id: str) -> tuple[str, bool]:
        """The name this node announces for a model, and whether it chose it (imported the
        file, or named it with `kvasird model add --name`) rather than adopted it from
        peers; ("", False) for a model it does not know."""
        row = self._db.execute(
            "SELECT name, source FROM shard_models WHERE model_id = ?", (model_id,)
        ).fetchone()
        if row is None or not NAME.fullmatch(row[0]):
            return "", False
        return row[0], row[1] != "peer"

    def manifest(self, model_id: str) -> Manifest:
        if model_id not in self._manifests:
            try:
                raw = self._manifest_path(model_id).read_bytes()
            except FileNotFoundError:
                raise StoreError(
                    f"no model {model_id[:16]} in {self.root}: see `kvasird model "
                    "list`, or add it with `kvasird model add`"
                ) from None
            self._manifests[model_id] = Manifest.from_bytes(raw, model_id)
        return self._manifests[model_id]

    def manifest_bytes(self, model_id: str) -> bytes | None:
        try:
            return self.manifest(model_id).raw
        except (StoreError, ManifestError):
            return None

    def resolve(self, ref: str) -> str:
        """A model id from a full id, an id prefix (MIN_PREFIX+ hex digits), a name or the
        slug of one (``names.named_by``), else a name a model had before; a text that names
        two models is refused with both ids."""
        ids = self._named(ref, "shard_models") or self._named(ref, "shard_names")
        if len(ids) > 1:
            listed = ", ".join(f"{mid} ({self.name_of(mid)})" for mid in ids)
            raise AmbiguousName(f"{ref!r} names several models here: {listed}: give the model id")
        if not ids:
            raise StoreError(f"no model here is named {ref!r}: see `kvasird model list`; {FORMS}")
        return ids[0]

    def _named(self, ref: str, table: str) -> list[str]:
        """The ids of the models ``ref`` names by the names ``table`` lists."""
        rows = self._db.execute(f"SELECT model_id, name FROM {table}").fetchall()
        return sorted({mid for mid, name in rows if named_by(ref, mid, name)})

    def name_of(self, model_id: str) -> str | None:
        """The name a model is listed under (`kvasird model add --name`, else its human
        name), or None if the store does not know it."""
        row = self._db.execute(
            "SELECT name FROM shard_models WHERE model_id = ?", (model_id,)
        ).fetchone()
        return row[0] if row and row[0] else None

    def models(self) -> list[ModelRecord]:
        out = []
        rows = self._db.execute(
            "SELECT model_id, name, arch, total_bytes, source FROM shard_models ORDER BY added_at"
        ).fetchall()
        for mid, name, arch, total, source in rows:
            held = self.held_units(mid)
            sizes = self.manifest(mid).unit_sizes
            out.append(
                ModelRecord(
                    mid, name, arch, total, sum(sizes.get(u, 0) for u in held), len(held), source
                )
            )
        return out

    def import_gguf(
        self, path: Path, name: str = "", source: str = "", progress: ImportProgress | None = None
    ) -> Manifest:
        """Import a full GGUF: every unit of the model becomes held here (a stored piece
        that no longer matches is replaced). ``progress(phase, done, total)`` follows
        the hashing of the file, then the storing of its pieces."""
        manifest = Manifest.from_gguf(
            path,
            progress=None
            if progress is None
            else (lambda done, total: progress("hashing", done, total)),
        )
        # a daemon importing its [market] model again keeps the name the owner gave it
        self.add_manifest(
            manifest,
            name,
            source or str(path),
            default=model_name({k: v for k, _, v in manifest.metadata}, path.name),
        )
        units = list(manifest.unit_sizes)
        self.begin(manifest.model_id, units)
        done, total = 0, manifest.total_bytes
        with gguf_pieces(path, manifest) as read:
            for piece in manifest.all_pieces:
                if not self.check_piece(piece):
                    self.put_piece(piece, read(piece))
                done += piece.length
                if progress is not None:
                    progress("storing", done, total)
        self.mark_held(manifest.model_id, units)
        return manifest

    def add(
        self, ref: ModelRef, name: str = "", progress: ImportProgress | None = None
    ) -> Manifest:
        """`kvasird model add`: import the GGUF of a path or bundled:NAME (not of an id)."""
        return self.import_gguf(ref.gguf(), name, source=str(ref), progress=progress)

    def drop_model(self, model_id: str) -> int:
        """Forget a model and delete its pieces; returns bytes freed."""
        freed = self.drop(model_id, [Unit.parse(u) for u in self._units(model_id, None)])
        with self._db:
            self._db.execute("DELETE FROM shard_models WHERE model_id = ?", (model_id,))
            self._db.execute("DELETE FROM shard_names WHERE model_id = ?", (model_id,))
        self._manifest_path(model_id).unlink(missing_ok=True)
        self._manifests.pop(model_id, None)
        return freed

    # units

    def held_units(self, model_id: str) -> list[Unit]:
        return sorted(Unit.parse(u) for u in self._units(model_id, "held"))

    def verified_held(self, model_id: str, units: Iterable[Unit]) -> list[Unit]:
        """Which of ``units`` are held with every piece intact (each blob hashed once per
        file version). Units with a corrupt piece stop being held (see ``check_piece``).
        Reads files: run it in a worker thread."""
        held = set(self.held_units(model_id)) & set(units)
        for piece in self.manifest(model_id).pieces(held):
            if not self.check_piece(piece):
                held.discard(piece.unit)
        return sorted(set(self.held_units(model_id)) & held)

    def begin(self, model_id: str, units: Iterable[Unit]) -> None:
        """Record that these units are being obtained, so gc keeps their pieces."""
        manifest = self.manifest(model_id)
        units = list(units)
        with self._db:
            for u in units:
                self._db.execute(
                    "INSERT OR IGNORE INTO shard_units VALUES (?, ?, 'pending')", (model_id, str(u))
                )
            refs = [(model_id, str(p.unit), p.sha256) for p in manifest.pieces(units)]
            self._db.executemany("INSERT OR IGNORE INTO shard_refs VALUES (?, ?, ?)", refs)

    def mark_held(self, model_id: str, units: Iterable[Unit]) -> None:
        units = list(units)
        missing = [p for p in self.manifest(model_id).pieces(units) if not self.has_piece(p)]
        if missing:
            raise StoreError(
                f"cannot hold {len(units)} units of {model_id[:16]}: "
                f"{len(missing)} pieces are missing (first: {missing[0].tensor})"
            )
        with self._db:
            self._db.executemany(
                "UPDATE shard_units SET state = 'held' WHERE model_id = ? AND unit = ?",
                [(model_id, str(u)) for u in units],
            )

    def drop(self, model_id: str, units: Iterable[Unit]) -> int:
        """Stop holding units; deletes pieces no other unit refers to. Returns bytes freed."""
        keys = [(model_id, str(u)) for u in units]
        with self._db:
            shas = {
                r[0]
                for k in keys
                for r in self._db.execute(
                    "SELECT sha256 FROM shard_refs WHERE model_id = ? AND unit = ?", k
                )
            }
            self._db.executemany("DELETE FROM shard_refs WHERE model_id = ? AND unit = ?", keys)
            self._db.executemany("DELETE FROM shard_units WHERE model_id = ? AND unit = ?", keys)
        return self._delete_unreferenced(shas)

    def gc(self) -> int:
        """Delete every blob and partial file no unit refers to; returns bytes freed."""
        found = {
            bytes.fromhex(p.name) for p in (self.root / "blobs").glob("*/*") if len(p.name) == 64
        }
        found |= {bytes.fromhex(p.name[:64]) for p in (self.root / "partial").glob("*.part")}
        return self._delete_unreferenced(found)

    # pieces

    def has_piece(self, piece: Piece) -> bool:
        return self._blob(piece.sha256).exists()

    def check_piece(self, piece: Piece) -> bool:
        """Whether the piece's blob is here and matches the manifest, hashed only when the
        file changed since it last did. A corrupt blob is deleted, every unit that needs
        it is no longer held (it is pending: a download fetches it again), and one
        warning says so."""
        path = self._blob(piece.sha256)
        if self._verified(path, piece.sha256.hex(), lambda: _file_sha256(path) == piece.sha256):
            return True
        if path.exists():
            self._corrupt(piece)
        return False

    def put_piece(self, piece: Piece, data: bytes | memoryview) -> None:
        """Store a whole piece after checking its hash."""
        if len(data) != piece.length or hashlib.sha256(data).digest() != piece.sha256:
            raise CorruptPiece(
                f"bytes for {piece.tensor} piece {piece.expert} do not match "
                "the manifest; they were not stored"
            )
        _write_atomic(self._blob(piece.sha256), data)
        self._remember(self._blob(piece.sha256), piece.sha256.hex())

    def accept_chunk(
        self, piece: Piece, offset: int, data: bytes | memoryview, expected: bytes
    ) -> bool:
        """Check one downloaded chunk against its hash and keep it; False if it is wrong.

        A single-chunk piece goes straight to its blob; chunks of a longer piece are
        written into its partial file until ``finish_piece``.
        """
        if hashlib.sha256(data).digest() != expected:
            return False
        if offset == 0 and len(data) == piece.length:
            _write_atomic(self._blob(piece.sha256), data)
            self._remember(self._blob(piece.sha256), piece.sha256.hex())
            return True
        fd = os.open(self._partial(piece.sha256), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        return True

    def finish_piece(self, piece: Piece) -> None:
        """Move a fully downloaded multi-chunk piece into the store after a final check."""
        part = self._partial(piece.sha256)
        if _file_sha256(part) != piece.sha256:
            part.unlink(missing_ok=True)
            raise CorruptPiece(
                f"{piece.tensor} piece {piece.expert} did not verify as a whole; "
                "its partial file was deleted, download it again"
            )
        self._blob(piece.sha256).parent.mkdir(exist_ok=True)
        part.replace(self._blob(piece.sha256))
        self._remember(self._blob(piece.sha256), piece.sha256.hex())

    def resume_point(self, piece: Piece, chunk_size: int) -> set[int]:
        """Indexes of chunks of a partially downloaded piece that are already good."""
        part = self._partial(piece.sha256)
        if not part.exists():
            return set()
        done = set()
        with open(part, "rb") as f:
            for i, (off, length, sha) in enumerate(piece.spans(chunk_size)):
                data = os.pread(f.fileno(), length, off)
                if len(data) == length and hashlib.sha256(data).digest() == sha:
                    done.add(i)
        return done

    def read_piece(self, piece: Piece) -> bytes:
        """A piece's bytes, verified (a corrupt blob is deleted and CorruptPiece raised)."""
        try:
            data = self._blob(piece.sha256).read_bytes()
        except FileNotFoundError:
            raise StoreError(
                f"{piece.tensor} piece {piece.expert} is not in the store: download its unit first"
            ) from None
        if hashlib.sha256(data).digest() != piece.sha256:
            self._corrupt(piece)
            raise CorruptPiece(
                f"stored {piece.tensor} piece {piece.expert} is corrupt and was "
                f"deleted: download its unit again ({piece.unit} is no longer "
                "held)"
            )
        return data

    def read_range(
        self, model_id: str, tensor: str, expert: int, offset: int, length: int
    ) -> bytes | None:
        """Bytes of a piece for a peer; None if we do not have it. A blob is verified
        before it is served (once per file version), so bit rot on disk is not passed on
        (and peers do not take us for a liar): a corrupt one is not had."""
        manifest = self._manifests.get(model_id) or self._try_manifest(model_id)
        if manifest is None:
            return None
        piece = manifest.piece(tensor, expert)
        if not 0 <= offset <= offset + length <= piece.length:
            raise StoreError(f"range {offset}+{length} is outside {tensor} piece {expert}")
        if not self.check_piece(piece):
            return None
        with open(self._blob(piece.sha256), "rb") as f:
            return os.pread(f.fileno(), length, offset)

    def write_slice(self, model_id: str, spec: SliceSpec, path: Path) -> Path:
        """Assemble a slice we hold as a mini-GGUF for the compute engine, verified."""
        manifest = self.manifest(model_id)
        held = set(self.held_units(model_id))
        missing = [u for u in units_of(manifest, spec) if u not in held]
        if missing:
            raise StoreError(
                f"{spec} of {model_id[:16]} is not held here (missing {missing[0]}): "
                "add the model or download the slice first"
            )
        # A file of its own per writer: the loader and the gateway may assemble the same
        # slice at once (a shared ".tmp" was renamed away under the other, which then
        # failed and took its daemon down). Both write the same verified bytes.
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            write_slice(manifest, spec, tmp, self.read_piece)
            verify_slice(tmp, manifest)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        self._remember(path, _slice_content(model_id, spec))
        return path

    def check_slice(self, model_id: str, spec: SliceSpec, path: Path) -> bool:
        """Whether an assembled slice file may be reused: it is there and every piece of it
        matches the manifest (hashed once per file version). A corrupt one is deleted,
        with one warning; assemble it again with ``write_slice``."""
        manifest = self.manifest(model_id)

        def intact() -> bool:
            try:
                return str(verify_slice(path, manifest).spec) == str(spec)
            except (ModelError, OSError, ValueError):
                return False

        if self._verified(path, _slice_content(model_id, spec), intact):
            return True
        if path.exists():
            log.warning(
                "stored slice is corrupt: deleted, assembling it again from the verified pieces",
                model=model_id[:16],
                slice=str(spec),
                path=str(path),
            )
            self._forget(path)
            path.unlink(missing_ok=True)
        return False

    # internals

    def _verified(self, path: Path, content: str, check: Callable[[], bool]) -> bool:
        """True when ``path`` exists and passed ``check`` for ``content`` in this version
        of the file (same size, mtime_ns and inode), or passes it now (then remembered)."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        row = self._db.execute(
            "SELECT content, size, mtime_ns, inode FROM shard_verified WHERE path = ?", (str(path),)
        ).fetchone()
        if row == (content, st.st_size, st.st_mtime_ns, st.st_ino):
            return True
        if not check():
            return False
        self._remember(path, content, st)
        return True

    def _remember(self, path: Path, content: str, st: os.stat_result | None = None) -> None:
        """Record that this version of the file holds ``content`` (written or checked)."""
        st = path.stat() if st is None else st
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO shard_verified VALUES (?, ?, ?, ?, ?)",
                (str(path), content, st.st_size, st.st_mtime_ns, st.st_ino),
            )

    def _forget(self, path: Path) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM shard_verified WHERE path = ?", (str(path),))

    def _corrupt(self, piece: Piece) -> list[Unit]:
        """Delete a blob that failed its hash; the units needing it are no longer held."""
        path = self._blob(piece.sha256)
        self._forget(path)
        path.unlink(missing_ok=True)
        with self._lock, self._db:
            rows = self._db.execute(
                "SELECT u.model_id, u.unit FROM shard_units u JOIN shard_refs r "
                "ON r.model_id = u.model_id AND r.unit = u.unit "
                "WHERE r.sha256 = ? AND u.state = 'held'",
                (piece.sha256,),
            ).fetchall()
            self._db.executemany(
                "UPDATE shard_units SET state = 'pending' WHERE model_id = ? AND unit = ?", rows
            )
        units = sorted(Unit.parse(u) for _, u in rows)
        log.warning(
            "stored shard piece is corrupt: deleted; its units are no longer held "
            "and are downloaded again",
            tensor=piece.tensor,
            expert=piece.expert,
            units=[str(u) for u in units],
            path=str(path),
        )
        return units

    def _try_manifest(self, model_id: str) -> Manifest | None:
        try:
            return self.manifest(model_id)
        except (StoreError, ManifestError):
            return None

    def _units(self, model_id: str, state: str | None) -> list[str]:
        rows = self._db.execute(
            "SELECT unit FROM shard_units WHERE model_id = ? AND (? IS NULL OR state = ?)",
            (model_id, state, state),
        )
        return [r[0] for r in rows]

    def _delete_unreferenced(self, shas: set[bytes]) -> int:
        freed = 0
        for sha in shas:
            if self._db.execute(
                "SELECT 1 FROM shard_refs WHERE sha256 = ? LIMIT 1", (sha,)
            ).fetchone():
                continue
            for path in (self._blob(sha), self._partial(sha)):
                with contextlib.suppress(FileNotFoundError):
                    freed += path.stat().st_size
                    path.unlink()
                    self._forget(path)
        return freed

    def _manifest_path(self, model_id: str) -> Path:
        if len(model_id) != 64 or not all(c in "0123456789abcdef" for c in model_id):
            raise StoreError(f"{model_id!r} is not a model id (64 hex digits)")
        return self.root / "manifests" / f"{model_id}.msgpack"

    def _blob(self, sha: bytes) -> Path:
        h = sha.hex()
        return self.root / "blobs" / h[:2] / h

    def _partial(self, sha: bytes) -> Path:
        return self.root / "partial" / f"{sha.hex()}.part"


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    tmp.replace(path)


def _slice_content(model_id: str, spec: SliceSpec) -> str:
    return f"{model_id}/{spec}"


def _file_sha256(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.digest()

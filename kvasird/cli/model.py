"""``kvasird model list|add|inspect|slice|drop``: the models and shards in this home."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from kvasird.cli import home_of
from kvasird.model.manifest import Manifest
from kvasird.model.names import MIN_PREFIX, checked_name, model_name
from kvasird.model.ref import ModelRef
from kvasird.model.slice import gguf_pieces, parse_spec, write_slice
from kvasird.model.store import ShardStore


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="models and shards held by this node")
    cmds = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    ls = cmds.add_parser("list", help="models known here and how much of each is held")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=_list)
    add = cmds.add_parser("add", help="import a full GGUF (a path, or bundled:smollm2)")
    add.add_argument("source", help="path of a .gguf file, or bundled:smollm2")
    add.add_argument(
        "--name",
        default="",
        help="its name on the network, family:tag (default: "
        "from the GGUF's metadata and file name, e.g. smollm2:135m-instruct)",
    )
    add.set_defaults(func=_add)
    ins = cmds.add_parser("inspect", help="manifest summary of a held model or a GGUF file")
    ins.add_argument(
        "model",
        help=f"model name, id or id prefix ({MIN_PREFIX}+ hex digits), or path of a .gguf file",
    )
    ins.add_argument("--units", action="store_true", help="list every unit with its size")
    ins.add_argument("--json", action="store_true", help="print JSON")
    ins.set_defaults(func=_inspect)
    sl = cmds.add_parser("slice", help="write a slice as a mini-GGUF")
    sl.add_argument("model", help="model name, id or id prefix, or path of a .gguf file")
    sl.add_argument("spec", help="layers=A:B, layers=A:B,no-experts, experts=L:E0:E1 or head")
    sl.add_argument("-o", "--output", type=Path, required=True, help="file to write")
    sl.set_defaults(func=_slice)
    drop = cmds.add_parser("drop", help="forget a model and delete its shards")
    drop.add_argument("model", help="model name, id or id prefix")
    drop.set_defaults(func=_drop)


def _store(args: argparse.Namespace) -> ShardStore:
    return ShardStore.open(home_of(args))


def _list(args: argparse.Namespace) -> int:
    with _store(args) as store:
        models = store.models()
    if args.json:
        print(json.dumps([dataclasses.asdict(m) for m in models], indent=2))
        return 0
    if not models:
        print("no models yet: `kvasird model add bundled:smollm2` or `kvasird model add FILE.gguf`")
        return 0
    print(f"{'name':32} {'model id':18} {'arch':10} {'held':>10} {'of':>10} {'units':>6}")
    for m in models:
        print(
            f"{m.name[:32]:32} {m.model_id[:16]:18} {m.arch:10} {_mb(m.held_bytes):>10} "
            f"{_mb(m.total_bytes):>10} {m.held_units:>6}"
        )
    return 0


def _add(args: argparse.Namespace) -> int:
    from kvasird.model.progress import Meter, TerminalBar

    t = time.perf_counter()
    ref = ModelRef.parse(args.source)
    name = checked_name(args.name, "--name") if args.name else ""
    if ref.kind == "path":  # refused before it is hashed and copied, with what is supported
        from kvasird.compute.arch import check_file

        check_file(Path(ref.value).expanduser())
    with _store(args) as store, TerminalBar("hashing", 0) as bar:
        meters: dict[str, Meter] = {}

        def progress(phase: str, done: int, total: int) -> None:
            now = time.monotonic()
            meter = meters.setdefault(phase, Meter(total, 0, now))
            meter.update(done, now)
            bar.show(meter, description=phase)

        manifest = store.add(ref, name, progress=progress)
        listed = store.name_of(manifest.model_id)
    print(f"added {listed} (id {manifest.model_id})")
    print(
        f"  {manifest.arch}, {manifest.n_layer} layers, {manifest.n_expert} experts, "
        f"{_mb(manifest.total_bytes)} in {len(manifest.unit_sizes)} units "
        f"({time.perf_counter() - t:.1f} s)"
    )
    return 0


def _manifest_of(args: argparse.Namespace, text: str) -> tuple[Manifest, Path | None, str]:
    """The manifest ``text`` names (ModelRef's forms), the GGUF it was read from (None for a
    model in the store) and the model's name."""
    ref = ModelRef.parse(text)
    if not ref.from_peers:
        path = ref.gguf()
        manifest = Manifest.from_gguf(path)
        return manifest, path, model_name({k: v for k, _, v in manifest.metadata}, path.name)
    with _store(args) as store:
        model_id = store.resolve(ref.value)
        return store.manifest(model_id), None, store.name_of(model_id) or ""


def _inspect(args: argparse.Namespace) -> int:
    manifest, _, name = _manifest_of(args, args.model)
    sizes = manifest.unit_sizes
    if args.json:
        print(
            json.dumps(
                {
                    "model_id": manifest.model_id,
                    "arch": manifest.arch,
                    "name": name,
                    "n_layer": manifest.n_layer,
                    "n_expert": manifest.n_expert,
                    "total_bytes": manifest.total_bytes,
                    "tensors": len(manifest.tensors),
                    "units": {str(u): n for u, n in sizes.items()},
                },
                indent=2,
            )
        )
        return 0
    kinds: dict[str, list[int]] = {}
    for u, n in sizes.items():
        kinds.setdefault(u.kind, []).append(n)
    print(f"model id   {manifest.model_id}")
    print(f"name       {name}")
    print(f"arch       {manifest.arch}, {manifest.n_layer} layers, {manifest.n_expert} experts")
    print(f"tensors    {len(manifest.tensors)}, {_mb(manifest.total_bytes)}")
    for kind, ns in sorted(kinds.items()):
        print(
            f"{kind:10} {len(ns)} units × {_mb(min(ns))}"
            + (f"..{_mb(max(ns))}" if max(ns) != min(ns) else "")
            + f" = {_mb(sum(ns))}"
        )
    if args.units:
        for u, n in sizes.items():
            print(f"  {str(u):16} {n:>14,}")
    return 0


def _slice(args: argparse.Namespace) -> int:
    spec = parse_spec(args.spec)
    manifest, path, _ = _manifest_of(args, args.model)
    if path is not None:
        with gguf_pieces(path, manifest) as read:
            write_slice(manifest, spec, args.output, read)
    else:
        with _store(args) as store:
            store.write_slice(manifest.model_id, spec, args.output)
    print(f"wrote {args.output} ({spec}, {_mb(args.output.stat().st_size)})")
    return 0


def _drop(args: argparse.Namespace) -> int:
    ref = ModelRef.parse(args.model)
    with _store(args) as store:
        model_id = store.resolve(ref.value)
        freed = store.drop_model(model_id)
    print(f"dropped {model_id[:16]}, freed {_mb(freed)}")
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"

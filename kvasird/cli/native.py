"""``kvasird native info``: what the installed ggml runtime offers."""

from __future__ import annotations

import argparse
import json

from kvasird.compute.runtime import probe


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("native", help="the native (ggml) runtime")
    cmds = p.add_subparsers(dest="native_command", metavar="ACTION", required=True)
    info = cmds.add_parser("info", help="backends, devices, ggml version and threads")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--threads", type=int, default=0, help="threads to report (0 = default)")
    info.set_defaults(func=_info)


def _info(args: argparse.Namespace) -> int:
    info = probe(args.threads)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    print(
        f"ggml runtime   ggml-python {info.ggml_python}, ggml {info.ggml_version} "
        f"({info.ggml_commit})"
    )
    print(f"backends       {', '.join(info.backends)}")
    for d in info.devices:
        print(f"device         {d.name} [{d.kind}] {d.description}")
    print(f"cpu features   {' '.join(info.cpu_features) or '-'}")
    print(f"threads        {info.threads}")
    return 0

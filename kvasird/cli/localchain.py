"""``kvasird localchain``: run the embedded Solana local chain on its own (demo, local networks)."""

from __future__ import annotations

import argparse
from pathlib import Path

import trio

from kvasird.cli import home_of
from kvasird.settlement.localchain import LocalChainInfo, serve_local_chain


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "localchain", help="run a local Solana chain (LiteSVM) with a KVR mint and faucet"
    )
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="data directory (default: <home>/localchain); state persists across restarts",
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:8899",
        help="loopback host:port of the JSON-RPC endpoint (port 0 picks a free one)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    data = (args.data or home_of(args).root / "localchain").expanduser().resolve()
    try:
        trio.run(_serve, data, args.listen)
    except KeyboardInterrupt:
        print("local chain stopped")
    return 0


async def _serve(data: Path, listen: str) -> None:
    async with trio.open_nursery() as nursery:
        info: LocalChainInfo = await nursery.start(serve_local_chain, data, listen)
        print(f"RPC URL         {info.url}")
        print(f"KVR mint        {info.mint}")
        print(f"genesis wallet  {info.genesis_wallet}")
        print(f"data            {info.data_dir}")
        print("faucet          `kvasird wallet --rpc URL faucet` (KVR and SOL)")
        print("Local chain is ready", flush=True)

"""``kvasird localchain``: run the embedded Solana local chain on its own (demo, local networks)."""

from __future__ import annotations

import argparse
from pathlib import Path

import trio

from kvasird.cli import home_of
from kvasird.settlement.localchain import LocalChainInfo, serve_local_chain
from kvasird.settlement.localchain.service import exposure, parse_listen


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "localchain",
        help="run a local Solana chain (LiteSVM) with a KVR mint and faucet",
        description="Run a local Solana chain with a KVR mint and a faucet. Nodes need only "
        "its RPC URL ([settlement] rpc_url): it tells them its mint and genesis wallet. It "
        "listens on loopback unless --listen names another address; then anyone who reaches "
        "it can mint test KVR and SOL from its faucet.",
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
        help="IP host:port of the JSON-RPC endpoint (default 127.0.0.1:8899; port 0 picks a "
        "free one). An address beyond loopback (e.g. 10.77.0.1:8899, for nodes on other "
        "machines) lets anyone who reaches it mint test KVR and SOL from the faucet",
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
        print(
            "faucet          `kvasird wallet --rpc URL faucet` (KVR and SOL; "
            "--stake: what a gateway needs)"
        )
        warning = exposure(parse_listen(listen)[0])
        if warning is not None:
            print(f"warning         {warning}")
        print("Local chain is ready", flush=True)

"""Running a local chain: ``await nursery.start(serve_local_chain, data_dir)``."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import trio
from solders.pubkey import Pubkey

from kvasird.settlement.errors import ChainError
from kvasird.settlement.localchain.chain import LocalChain
from kvasird.settlement.localchain.http import serve_http
from kvasird.settlement.localchain.rpc import RpcHandler


@dataclass(frozen=True)
class LocalChainInfo:
    """What a started local chain tells its caller."""

    url: str
    """JSON-RPC URL, http://127.0.0.1:<port>."""
    mint: Pubkey
    """The KVR mint created at genesis."""
    genesis_wallet: Pubkey
    """Mint authority and faucet; the only signer of governance messages on this network."""
    data_dir: Path
    """Where the chain keeps genesis.json and chain.db."""


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` with a loopback host; the local chain is never exposed."""
    host, sep, port = listen.rpartition(":")
    try:
        if not sep or not ipaddress.ip_address(host).is_loopback or not 0 <= int(port) < 65536:
            raise ValueError
    except ValueError:
        raise ChainError(
            f"local chain listen address {listen!r} must be a loopback host:port, "
            "e.g. 127.0.0.1:8899 (port 0 picks a free one)"
        ) from None
    return host, int(port)


async def serve_local_chain(
    data_dir: Path,
    listen: str = "127.0.0.1:0",
    *,
    task_status: trio.TaskStatus[LocalChainInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the local chain until cancelled; ``started`` once its RPC port accepts connections."""
    host, port = parse_listen(listen)
    chain = LocalChain(data_dir)
    try:
        async with trio.open_nursery() as nursery:
            try:
                bound = await nursery.start(serve_http, RpcHandler(chain).handle, host, port)
            except OSError as exc:
                raise ChainError(
                    f"cannot listen on {listen} ({exc.strerror}): choose another port "
                    "with --listen or [settlement] local_chain_listen"
                ) from None
            task_status.started(
                LocalChainInfo(f"http://{host}:{bound}", chain.mint, chain.authority, data_dir)
            )
    finally:
        chain.close()

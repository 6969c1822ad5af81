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
    """JSON-RPC URL, http://<listen host>:<port>."""
    mint: Pubkey
    """The KVR mint created at genesis."""
    genesis_wallet: Pubkey
    """Mint authority and faucet; the only signer of governance messages on this network."""
    data_dir: Path
    """Where the chain keeps genesis.json and chain.db."""


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` with an IP host. Loopback is the default everywhere; another address is
    taken only when an operator names it (a network built by hand on several machines needs
    them to reach one chain), and ``exposure`` says what that means."""
    host, sep, port = listen.rpartition(":")
    try:
        if not sep or not 0 <= int(port) < 65536:
            raise ValueError
        ipaddress.ip_address(host)
    except ValueError:
        raise ChainError(
            f"local chain listen address {listen!r} must be an IP host:port, e.g. "
            "127.0.0.1:8899 (port 0 picks a free one), or this machine's address on a "
            "network you trust, e.g. 10.77.0.1:8899"
        ) from None
    return host, int(port)


def exposure(host: str) -> str | None:
    """The warning a local chain listening on ``host`` deserves (None on loopback): its faucet
    answers whoever reaches it, and KVR from it is what a gateway's stake is checked in."""
    if ipaddress.ip_address(host).is_loopback:
        return None
    return (
        f"the local chain listens on {host}, beyond this machine: anyone who reaches it can "
        "mint test KVR and SOL from its faucet (a gateway's stake included); listen only on "
        "a network you trust"
    )


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

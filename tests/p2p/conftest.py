"""Real libp2p hosts in one process (TCP + Noise + yamux on 127.0.0.1), built as the
daemon builds them."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import multiaddr
import pytest
from libp2p.abc import IHost

from kvasird.identity.nodekey import create_node_key
from kvasird.p2p.host import build_host, parse_listen

_serial = itertools.count()


@asynccontextmanager
async def running_hosts(tmp: Path, psks: list[str | None]) -> AsyncIterator[list[IHost]]:
    """One listening host per entry of ``psks`` (None: no private-network key)."""
    async with AsyncExitStack() as stack:
        hosts = []
        for psk in psks:
            listen = parse_listen(("/ip4/127.0.0.1/tcp/0",))
            host = build_host(create_node_key(tmp / f"h{next(_serial)}.key"), listen, [], 8, psk)
            await stack.enter_async_context(host.run([multiaddr.Multiaddr(a) for a in listen]))
            stack.push_async_callback(_close_all, host)
            hosts.append(host)
        yield hosts


async def _close_all(host: IHost) -> None:
    for pid in list(host.get_network().connections):
        with contextlib.suppress(Exception):  # best effort on teardown
            await host.get_network().close_peer(pid)


@pytest.fixture
def hosts(tmp_path: Path) -> Callable[[list[str | None]], object]:
    return lambda psks: running_hosts(tmp_path, psks)

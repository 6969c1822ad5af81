"""The shard protocol mounted on a real libp2p stream (TCP + Noise + yamux, two hosts)."""

from __future__ import annotations

import multiaddr
import pytest

from kvasird.identity.nodekey import create_node_key
from kvasird.model.slice import LayerWindow, units_of
from kvasird.model.transfer import download, serve_shards
from kvasird.wire.protocols import SHARD_PROTOCOL
from kvasird.p2p.host import build_host, parse_listen

pytestmark = pytest.mark.slow


async def test_a_window_downloads_over_a_libp2p_stream(source_store, store_factory, moe_manifest,
                                                       tmp_path):
    listen = [parse_listen(("/ip4/127.0.0.1/tcp/0",)) for _ in range(2)]
    a = build_host(create_node_key(tmp_path / "a.key"), listen[0], [], 8)
    b = build_host(create_node_key(tmp_path / "b.key"), listen[1], [], 8)
    b.set_stream_handler(SHARD_PROTOCOL, lambda stream: serve_shards(stream, source_store))
    client = store_factory("client")
    units = units_of(moe_manifest, LayerWindow(0, 2))

    async def open_stream(peer):
        return await a.new_stream(peer, [SHARD_PROTOCOL])

    async with a.run([multiaddr.Multiaddr(x) for x in listen[0]]), \
            b.run([multiaddr.Multiaddr(x) for x in listen[1]]):
        a.get_peerstore().add_addrs(b.get_id(), b.get_addrs(), 3600)
        await a.connect(a.get_peerstore().peer_info(b.get_id()))
        try:
            report = await download(client, moe_manifest.model_id, units, [b.get_id()],
                                    open_stream, stall_timeout=10)
        finally:
            for host in (a, b):
                for pid in list(host.get_network().connections):
                    await host.get_network().close_peer(pid)
    assert report.received_bytes == report.total_bytes == sum(
        moe_manifest.unit_sizes[u] for u in units)
    assert client.held_units(moe_manifest.model_id) == sorted(units)

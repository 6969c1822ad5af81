"""Integrity at rest between real daemons: a byte damaged in a node's stored slice and in
the piece it was assembled from is caught when the node restarts, the piece is
downloaded again from a peer, and the node computes the right tokens again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_swarm import PROMPTS, all_online, generate, routable  # type: ignore[import-not-found]

from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LocalNode
from kvasird.localnet.placement import pinned
from kvasird.model.bundled import bundled_path
from kvasird.model.gguffile import read_header
from kvasird.model.manifest import Manifest

pytestmark = pytest.mark.slow

ROUTED_S = 120.0
DAMAGED = "blk.20.ffn_down.weight"
"""A Q4_1 tensor of the second node's window: its first block starts with an f16 scale."""


def damage(path: Path, offset: int) -> None:
    """Set the high byte of the f16 scale at ``offset`` to 0x7e: the scale reads NaN."""
    with open(path, "r+b") as f:
        f.seek(offset + 1)
        f.write(b"\x7e")


def count(node: LocalNode, text: str) -> int:
    return sum(text in line for line in node.log.read_text(errors="replace").splitlines())


def wait_serving(net: LocalNet) -> None:
    net.wait_until("the gateway sees both nodes online", lambda: all_online(net.nodes[0], 2),
                   ROUTED_S)
    net.wait_until("the gateway has a route", lambda: routable(net.nodes[0]), ROUTED_S)


def test_a_damaged_slice_is_caught_on_restart_downloaded_again_and_served_right(
        localnet: Callable[..., LocalNet]) -> None:
    path = bundled_path()
    manifest = Manifest.from_gguf(path)
    net = localnet(2)
    seed, node = net.nodes
    net.settings = {**net.settings, **pinned(path, ["head", "layers:0-15"])}
    join = net.configure(seed, [])
    net.settings = {**net.settings, **pinned(path, ["layers:15-30"]),
                    "market.model": manifest.model_id}  # fetched from the seed
    net.configure(node, [join])
    for n in net.nodes:
        n.spawn()
    for n in net.nodes:
        n.wait_ready()
    wait_serving(net)
    reference = generate(seed, PROMPTS[0])
    node.stop()

    [slice_file] = (node.home.root / "slices" / manifest.model_id).glob("layers-15_30*.gguf")
    header = read_header(slice_file)
    [tensor] = [t for t in header.tensors if t.name == DAMAGED]
    damage(slice_file, header.data_offset + tensor.offset)
    piece = manifest.piece(DAMAGED, -1)
    damage(node.home.shards / "blobs" / piece.sha256.hex()[:2] / piece.sha256.hex(), 0)

    node.start()
    wait_serving(net)
    assert generate(seed, PROMPTS[0]) == reference
    assert count(node, "stored shard piece is corrupt") == 1
    assert count(node, "stored slice is corrupt") == 1
    report = node.get("/v0/shards")["last_download"]
    assert report["received_bytes"] == piece.length  # only the damaged piece, from the seed
    assert report["bad_holders"] == []

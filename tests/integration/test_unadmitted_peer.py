"""What a foreign libp2p peer with no session can make a real daemon do on the data plane:
read a large frame (it is refused from its length, and never decoded), or compute expert
rows for a gateway it names (it must carry that gateway's signed delegation)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from fuzz_peer import generate_ok, start_target  # type: ignore[import-not-found]
from gossip_peer import GossipPeer  # type: ignore[import-not-found]
from libp2p.peer.id import ID

from kvasird.inference.protocol import EXPERT_PROTOCOL, STAGE_PROTOCOL, tensors
from kvasird.inference.protocol.delegation import DOMAIN, Delegation
from kvasird.localnet import LocalNet
from kvasird.wire import FrameReader, frame

pytestmark = pytest.mark.slow

FRAMES = 12
STEP_BYTES = 60 << 20
"""Each frame's rows: f16, widened to f32 they would take twice this."""
RSS_GROWTH = 8 << 20
"""Most the daemon's resident memory may grow by over all the frames."""


def rss(pid: int) -> int:
    """Resident memory of process `pid`, in bytes (/proc/PID/status: VmRSS, in kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


async def ask(rogue: GossipPeer, target: str, protocol: str, msg: dict[str, Any]
              ) -> dict[str, Any]:
    """Send `msg` on a new stream of `protocol` to `target`; its first reply frame."""
    stream = await rogue.host.new_stream(ID.from_base58(target), [protocol])
    try:
        with trio.fail_after(60):
            await stream.write(frame(msg, 128 << 20))
            return await FrameReader(stream, 1 << 20).read()
    finally:
        with trio.move_on_after(1):
            await stream.reset()


def test_a_peer_with_no_session_cannot_make_a_node_read_large_stage_frames(
        localnet: Callable[..., LocalNet]) -> None:
    """Twelve near-64 MiB stage steps of f16 rows for a session that does not exist: each
    is refused from its length with a reason, and the daemon's memory stays where it was
    (read and decoded, they once cost it 379 MiB); it serves generations after."""
    net = localnet(2)
    target = start_target(net)
    assert target.proc is not None
    rows = STEP_BYTES // 2 // 1024
    step = {"op": "step", "sid": "nobody", "start": 0, "id": 1,
            "x": {"dt": "f16", "shape": [rows, 1024], "data": bytes(STEP_BYTES)}}
    replies: list[dict[str, Any]] = []
    grew = [0]

    async def attack() -> None:
        rogue = GossipPeer("localnet")
        async with rogue.running(target.join_addr):
            before = rss(target.proc.pid)
            for _ in range(FRAMES):
                replies.append(await ask(rogue, target.peer_id, STAGE_PROTOCOL, step))
            grew[0] = rss(target.proc.pid) - before

    trio.run(attack)
    print(f"{FRAMES} frames of {STEP_BYTES >> 20} MiB: the daemon grew by {grew[0] >> 10} KiB")
    assert target.alive(), target.tail()
    for reply in replies:
        assert reply["code"] == "bad" and "no session here" in reply["error"], reply
    assert grew[0] < RSS_GROWTH, f"the daemon grew by {grew[0] >> 20} MiB"
    assert generate_ok(target)


def test_an_expert_worker_computes_for_no_gateway_named_without_its_delegation(
        localnet: Callable[..., LocalNet]) -> None:
    """No `for`, an empty one, the worker's own id, another node's id, and a delegation in
    that node's name the caller signed itself: each refused, saying what is wrong."""
    net = localnet(2)
    target = start_target(net)
    other = net.nodes[1].peer_id
    base = {"op": "experts", "layer": 0, "first": 0, "id": 1,
            "rows": tensors.encode(np.ones((1, 64), np.float32), "f32"),
            "ids": tensors.encode(np.array([[0, 1]]), "i32")}
    replies: dict[str, dict[str, Any]] = {}

    async def attack() -> None:
        rogue = GossipPeer("localnet")
        body = Delegation("localnet", other, rogue.peer_id, 4e9).body()
        forged = body + rogue.host.get_private_key().sign(DOMAIN + body)
        cases: dict[str, Any] = {"missing": None, "empty": [], "itself": [target.peer_id],
                                 "other": [other], "other, paired": [[other, 1]],
                                 "forged": [[forged, 1]]}
        async with rogue.running(target.join_addr):
            for name, groups in cases.items():
                msg = base if groups is None else {**base, "for": groups}
                replies[name] = await ask(rogue, target.peer_id, EXPERT_PROTOCOL, msg)

    trio.run(attack)
    assert target.alive(), target.tail()
    for name in ("missing", "empty"):
        assert replies[name]["code"] == "unpaid", replies[name]
        assert "names no gateway" in replies[name]["error"]
    for name in ("itself", "other", "other, paired"):
        assert replies[name]["code"] == "bad", replies[name]
        assert "experts.for: expected [delegation, rows]" in replies[name]["error"]
    assert replies["forged"]["code"] == "unpaid"
    assert f"not signed by gateway {other}" in replies["forged"]["error"]
    assert generate_ok(target)

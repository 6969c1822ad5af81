"""Shards between real daemons: each downloads only the slice it enrolled into."""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from faulty_daemon import command  # type: ignore[import-not-found]

from kvasird.localnet import LocalNet
from kvasird.market.pinning import parse_hold
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest

pytestmark = pytest.mark.slow

FAST = {"market.heartbeat_s": 1.0, "market.rebalance_s": 2.0, "market.enroll_delay_s": 0.5,
        "gateway.enabled": False}


@pytest.fixture(scope="module")
def bundled() -> tuple[Path, Manifest]:
    path = bundled_path()
    return path, Manifest.from_gguf(path)


def configure(net: LocalNet, index: int, **settings: object) -> None:
    """Set up node ``index`` with its own market settings, joined to node 0."""
    net.settings = {**FAST, **settings}
    seed = net.nodes[0]
    net.configure(net.nodes[index], [seed.join_addr] if index else [])


def slice_bytes(manifest: Manifest, pins: list[str]) -> int:
    units = {u for pin in pins for u in parse_hold(pin)}
    return sum(manifest.unit_sizes[u] for u in units)


def holding(manifest: Manifest, pins: list[str]) -> dict[str, object]:
    """Settings of a node that names the model by id and holds ``pins`` (fetched from peers),
    with a budget just big enough for them."""
    return {"market.model": manifest.model_id, "market.hold": pins,
            "market.memory_budget_mb": math.ceil(slice_bytes(manifest, pins) / 2**20)}


def held(node) -> int:  # noqa: ANN001
    return sum(m["held_bytes"] for m in node.get("/v0/shards")["models"])


def progress_events(node) -> list[dict]:  # noqa: ANN001
    """The node's "shard download progress" log events (its log is JSON off a terminal)."""
    out = []
    for line in node.log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "shard download progress":
            out.append(event)
    return out


def test_nodes_download_only_their_windows_from_the_seed(
        localnet: Callable[..., LocalNet], bundled: tuple[Path, Manifest]) -> None:
    path, manifest = bundled
    net = localnet(3)
    seed, a, b = net.nodes
    configure(net, 0, **{"market.model": str(path)})
    seed.start()
    pins = {1: ["head", "layers:0-15"], 2: ["layers:15-30"]}
    for i, node in ((1, a), (2, b)):
        configure(net, i, **holding(manifest, pins[i]))
        node.start()
    for node in (a, b):
        want = slice_bytes(manifest, pins[node.index])
        net.wait_until(f"node {node.index} holds its {want} bytes",
                       lambda node=node, want=want: held(node) >= want, timeout=90)
        shards = node.get("/v0/shards")
        report = shards["last_download"]
        assert want <= report["received_bytes"] <= want * 1.02
        assert report["bad_holders"] == []
        assert held(node) < 0.7 * manifest.total_bytes  # a slice, not the model
        # the download was followed: periodic log events, and the numbers in /v0/shards
        events = progress_events(node)
        assert events and events[-1]["bytes"] == events[-1]["total"] == want
        assert events[-1]["units_done"] == events[-1]["units"] == len(
            {u for pin in pins[node.index] for u in parse_hold(pin)})
        assert all({"unit", "mb_s", "eta_s", "pct", "holders"} <= set(e) for e in events)
        progress = shards["progress"]
        assert progress["finished"] and progress["done_bytes"] == progress["total_bytes"] == want
        assert sum(u["total_bytes"] for u in progress["units"]) == want
        assert all(u["done_bytes"] == u["total_bytes"] for u in progress["units"])
    assert held(seed) == manifest.total_bytes


def test_download_resumes_from_another_holder_when_the_source_dies(
        localnet: Callable[..., LocalNet], bundled: tuple[Path, Manifest]) -> None:
    path, manifest = bundled
    net = localnet(3)
    slow, other, learner = net.nodes
    slow.command = command(f"slow={20 * 2**20}")   # 20 MB/s: ~5 s for the model
    other.command = command(f"slow={10 * 2**20}")
    for i in (0, 1):
        configure(net, i, **{"market.model": str(path)})
        net.nodes[i].start()
    configure(net, 2, **holding(manifest, ["head", "layers:0-30"]))
    learner.start()
    net.wait_until("the download is under way",
                   lambda: (learner.get("/v0/shards")["progress"] or {}).get("done_bytes", 0) > 10 * 2**20,
                   timeout=60)
    slow.signal(signal.SIGKILL)
    net.wait_until("the learner holds the whole model",
                   lambda: held(learner) >= manifest.total_bytes, timeout=120)
    report = learner.get("/v0/shards")["last_download"]
    assert report["bad_holders"] == []


def test_holder_that_flips_bytes_is_detected_and_avoided(
        localnet: Callable[..., LocalNet], bundled: tuple[Path, Manifest]) -> None:
    path, manifest = bundled
    net = localnet(3)
    liar, honest, learner = net.nodes
    liar.command = command("flip")
    for i in (0, 1):
        configure(net, i, **{"market.model": str(path)})
        net.nodes[i].start()
    pins = ["layers:0-10"]
    configure(net, 2, **holding(manifest, pins))
    learner.start()
    want = slice_bytes(manifest, pins)
    net.wait_until("the learner holds its window", lambda: held(learner) >= want, timeout=90)
    report = learner.get("/v0/shards")["last_download"]
    assert report["bad_holders"] in ([], [liar.peer_id])
    # Caught by the challenge of its claim (usually before the download began), or while
    # downloading: either way a liar, out of the learner's map.
    net.wait_until("the learner took the flipper for a liar", lambda: liar.peer_id in (
        learner.get("/v0/coverage")["proofs"]["liars"]), timeout=30)
    if report["bad_holders"]:
        assert report["rejected_bytes"] > 0
        assert "shard holder sent wrong bytes" in learner.log.read_text()
    assert liar.peer_id not in learner.get("/v0/coverage")["holders"]


def test_a_restart_takes_back_its_holdings_and_a_new_placement_prunes_the_store(
        localnet: Callable[..., LocalNet], bundled: tuple[Path, Manifest]) -> None:
    """The seed has the model on disk and holds nothing in memory, so every layer is equally
    scarce: the node takes ten at a random place. Restarted, it takes the same ten back
    (nothing downloaded); given other units to hold, its store drops the old ones."""
    path, manifest = bundled
    net = localnet(2)
    seed, node = net.nodes
    configure(net, 0, **{"market.model": str(path)})
    seed.start()
    ten = slice_bytes(manifest, ["layers:0-10"])
    budget_mb = math.ceil(ten / 2**20)
    configure(net, 1, **{"market.model": manifest.model_id, "market.memory_budget_mb": budget_mb})
    node.start()

    def holdings() -> list[str]:
        view = node.get("/v0/coverage")
        return view["held"] if view["state"] == "online" and view["held"] else []

    net.wait_until("the node holds its layers", lambda: bool(holdings()), timeout=90)
    before = holdings()
    assert len(before) >= 9 and held(node) <= budget_mb * 2**20
    node.stop()
    node.start()
    net.wait_until("the restarted node holds layers again", lambda: bool(holdings()), timeout=90)
    assert holdings() == before
    assert node.get("/v0/shards")["last_download"] is None  # taken from its own disk

    node.stop()
    other = ["layers:20-30"] if "layer:20" not in before else ["layers:0-10"]
    configure(net, 1, **holding(manifest, other))
    node.start()
    want = sorted(str(u) for pin in other for u in parse_hold(pin))
    net.wait_until("the node holds its new window", lambda: sorted(holdings()) == want, timeout=90)
    budget = math.ceil(slice_bytes(manifest, other) / 2**20) * 2**20
    net.wait_until("its store is back within the budget", lambda: held(node) <= budget, timeout=30)
    blobs = sum(p.stat().st_size for p in (node.home.shards / "blobs").rglob("*") if p.is_file())
    assert blobs <= budget
    slices = sorted(p.name for p in (node.home.root / "slices").rglob("*.gguf"))
    assert slices == [f"layers-{other[0][7:].replace('-', '_')}+no-experts.gguf"]

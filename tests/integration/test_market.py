"""The coverage market across ten real daemons on 127.0.0.1."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio
from gossip_peer import GossipPeer  # type: ignore[import-not-found]

from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LocalNetError
from kvasird.market.model import MarketModel
from kvasird.market.records import CoverageRecord, Holding
from kvasird.market.service import MIN_TTL_S
from kvasird.model.manifest import Manifest
from kvasird.wire import pack
from kvasird_dev.testmodels import make_model

pytestmark = pytest.mark.slow

N_NODES = 10
HEARTBEAT_S = 2.0  # records live MIN_TTL_S (10 s): a busy 2-core box delays heartbeats seconds
CONVERGE_S = 90.0
HOT_CONVERGE_S = 180.0
"""Skewed demand moves replicas over several rebalance rounds; on a 2-core machine at the
end of the full suite that has taken more than 90 s (alone: ~20 s)."""


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MarketModel]:
    """8 layers x 64 experts, Q8_0, tied head: about 58 MiB."""
    path = make_model(tmp_path_factory.mktemp("moe") / "moe.gguf", n_layer=8, n_expert=64,
                      n_embd=128, n_ff_exp=256, dtype="q8_0", tied_output=True)
    return path, MarketModel.from_manifest(Manifest.from_gguf(path))


def market_net(localnet: Callable[..., LocalNet], moe: tuple[Path, MarketModel], n: int,
               budget_mb: int) -> LocalNet:
    path, _ = moe
    return localnet(n, settings={
        "market.model": str(path), "market.memory_budget_mb": budget_mb,
        "market.heartbeat_s": HEARTBEAT_S, "market.rebalance_s": 2.0,
        "market.enroll_delay_s": 3.0, "market.target_replicas": 2,
        # The market alone: units count as held once their bytes are here; loading them
        # into ggml is the inference tests' business (and costs ten daemons a lot of CPU).
        "inference.serve": False, "gateway.enabled": False})


def covered(net: LocalNet) -> bool:
    return all(n.get("/v0/coverage")["fully_covered"] for n in net.nodes if n.alive())


def budget_for(model: MarketModel, survivors: int) -> int:
    """Enough for `survivors` nodes to hold 2 replicas of everything, with 25% slack."""
    return int(2 * model.total_bytes * 1.25 / survivors / 2**20) + 1


def test_ten_daemons_cover_every_unit_and_recover_the_units_of_killed_holders(
        localnet: Callable[..., LocalNet], moe: tuple[Path, MarketModel]) -> None:
    """Ten daemons with budgets for 2 replicas among 7 cover everything within their
    budgets; when 3 are killed, the survivors' maps drop them and re-cover their units.
    (One network for both halves: ten daemons cost a 2-core machine ~40 s to converge.)"""
    _, model = moe
    net = market_net(localnet, moe, N_NODES, budget_for(model, N_NODES - 3))
    net.up()
    took = net.wait_until("every unit reaches 2 replicas on every node's map",
                          lambda: covered(net), timeout=CONVERGE_S)
    net.wait_until("every node's map lists all ten nodes",
                   lambda: all(len(n.get("/v0/coverage")["holders"]) == N_NODES for n in net.nodes),
                   timeout=30)
    for node in net.nodes:
        view = node.get("/v0/coverage")
        assert view["held_bytes"] <= view["budget_bytes"]
        assert view["rejected"] == {}

    victims = net.nodes[2:5]
    dead = {v.peer_id for v in victims}
    for v in victims:
        v.signal(signal.SIGKILL)
    survivors = [n for n in net.nodes if n not in victims]
    gone = net.wait_until(
        "the survivors' maps drop the killed nodes",
        lambda: all(not dead & set(n.get("/v0/coverage")["holders"]) for n in survivors),
        timeout=MIN_TTL_S + HEARTBEAT_S + 10)
    recovered = net.wait_until("the survivors re-cover every unit", lambda: covered(net),
                               timeout=CONVERGE_S)
    print(f"converged {took:.1f} s after all were ready; dead holders expired after {gone:.1f} s;"
          f" units re-covered {recovered:.1f} s later")
    for node in survivors:
        view = node.get("/v0/coverage")
        assert view["held_bytes"] <= view["budget_bytes"]
        assert view["rejected"] == {}


def test_hot_experts_end_with_more_replicas_than_cold_ones(
        localnet: Callable[..., LocalNet], moe: tuple[Path, MarketModel]) -> None:
    _, model = moe
    net = market_net(localnet, moe, N_NODES, budget_for(model, N_NODES - 3))
    net.up()
    hot = range(0, 4)
    counts = tuple((layer, e, 400 if e in hot else 10) for layer in range(8) for e in range(64))

    # The reports come from a py-libp2p peer in a process of its own: run in the test
    # process after some in-process libp2p tests (tests/inference/test_lane.py), its reports
    # reliably had no effect, for a reason not found yet; alone they always did. It keeps
    # publishing while the test waits, and keeps a connection to every node: a daemon drops
    # a peer whose heartbeat answers come late (ten daemons hashing the model on a loaded
    # 2-core machine), and a reporter connected to node 0 alone then published to no one.
    script = f"""
import sys, time, trio
sys.path.insert(0, {str(Path(__file__).parent)!r})
from gossip_peer import GossipPeer
from kvasird.market.records import LoadReport
from kvasird.wire import pack

async def main():
    peer = GossipPeer("localnet")
    async with peer.running({net.nodes[0].join_addr!r}):
        for seq in range(1, {int(HOT_CONVERGE_S)}):
            await peer.stay_connected({[n.join_addr for n in net.nodes]!r})
            report = LoadReport(peer.peer_id, seq, time.time(), {model.model_id!r}, 60.0,
                                10_000, {counts!r})
            await peer.publish("load", pack(report.to_wire()))
            await trio.sleep(1)

trio.run(main)
"""
    reporter = subprocess.Popen([sys.executable, "-c", script])

    def hot_have_more() -> bool:
        segs = net.nodes[-1].get("/v0/coverage").get("segments")  # absent until it has the model
        experts = [s for s in segs or () if s["unit"] == "experts"]
        if not experts:
            return False
        hot_min = min(s["replicas"] for s in experts if s["experts"][0] < 4)
        cold_max = max(s["replicas"] for s in experts if s["experts"][1] > 4)
        return hot_min > cold_max and covered(net)

    def where_it_stands() -> str:
        """Per node: the hot experts' (replicas, target) of layer 0, and whether covered: a
        target of 2 means no load report reached that node."""
        out = []
        for node in net.nodes:
            try:
                view = node.get("/v0/coverage")
            except (httpx.HTTPError, LocalNetError) as exc:
                out.append(f"node{node.index}: {exc!r}")
                continue
            hot0 = [(s["replicas"], s["target"]) for s in view.get("segments") or ()
                    if s["unit"] == "experts" and s["layer"] == 0 and s["experts"][0] < 4]
            out.append(f"node{node.index}: hot {hot0} covered {view.get('fully_covered')}")
        return "; ".join(out)

    try:
        net.wait_until("hot experts have more replicas than any cold one", hot_have_more,
                       timeout=HOT_CONVERGE_S)
    except LocalNetError as exc:
        raise AssertionError(f"{exc}\n{where_it_stands()}") from None
    finally:
        reporter.kill()
        reporter.wait()


def test_adversarial_gossip_never_enters_an_honest_map(
        localnet: Callable[..., LocalNet], moe: tuple[Path, MarketModel]) -> None:
    _, model = moe
    net = market_net(localnet, moe, 3, budget_for(model, 2))
    net.up()
    net.wait_until("the market converges", lambda: covered(net), timeout=CONVERGE_S)
    honest = net.nodes[1].peer_id
    before = {n.peer_id: n.get("/v0/coverage")["holders"] for n in net.nodes}

    def forged(**over: object) -> bytes:
        r = CoverageRecord(rogue.peer_id, 10, time.time(), 3.0, "online", 1, "evil", (),
                           model.model_id, 2**40, (Holding("H", 0, 0, 1, "online"),))
        return pack({**r.to_wire(), **over})

    rogue = GossipPeer("localnet")

    async def attack() -> None:
        async with rogue.running(net.nodes[0].join_addr):
            bad = [
                b"\xc1 this is not msgpack",
                pack({"v": 1, "peer": rogue.peer_id, "blob": "x" * 300_000}),  # oversized
                forged(peer=honest),                                           # forged peer id
                forged(holdings=[["L", 0, 5000, "online"]]),                   # absurd holdings
                forged(holdings=[["E", 7, 0, 64, "online"]] * 4000),  # too many holdings
                forged(ts=time.time() - 3600),                                 # stale clock
                forged(budget=1, holdings=[["L", 0, 8, "online"]]),            # beyond its budget
                pack({"v": 1, "peer": rogue.peer_id, "seq": 1, "ts": time.time(), "model": "zz",
                      "window_s": 1, "tokens": 1, "experts": []}),             # bad load report
            ]
            for data in bad:
                await rogue.publish("coverage" if b"blob" in data or b"holdings" in data
                                    or data.startswith(b"\xc1") else "load", data)
                await trio.sleep(0.2)
            await trio.sleep(3)
            # Scores are kept for connected peers only: read it before the rogue leaves.
            view = await trio.to_thread.run_sync(net.nodes[0].get, "/v0/coverage")
            scores.update(view["gossip_scores"])

    scores: dict[str, float] = {}
    trio.run(attack)
    time.sleep(2 * HEARTBEAT_S)
    for node in net.nodes:
        assert node.alive()
        view = node.get("/v0/coverage")
        assert rogue.peer_id not in view["holders"]
        assert set(view["holders"]) == set(before[node.peer_id])
    target = net.nodes[0].get("/v0/coverage")
    assert target["rejected"].get(rogue.peer_id, 0) >= 6
    assert scores[rogue.peer_id] < 0


"""Reachability on loopback with real daemons: network identity, dial-back, relays, DHT.

A node is made "private" on loopback by announcing an address where nothing listens:
the dial-back check then fails exactly as it does behind a NAT, and everything after
(reservations, circuit addresses, relayed dials) is the real code path.

The NAT tests use a real NAT built from network namespaces (netns, see netns.py): it
creates its own namespaces with 10.77.x.x test addresses and removes them afterwards,
and skips with the reason where namespaces or NAT tools are not available.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from netns import LAN_IP, PUB_IP, Nat, NetnsUnavailable

from kvasird.config import render
from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import READY_TIMEOUT_S, LocalNetError, LocalNode, free_port
from tests.support import eventually

pytestmark = pytest.mark.slow

# Ten daemons in a chain with peer exchange off, on a 2-core machine: every node knows
# every other within this bound, through DHT lookups alone.
DHT_CHAIN_BOUND_S = 60.0


def start(net: LocalNet, bootstrap: dict[int, int], extra: dict[int, dict[str, Any]]) -> None:
    """Configure each node (bootstrap: node -> the node it joins through), then start all."""
    addrs = {}
    for node in net.nodes:
        addrs[node.index] = net.configure(node, [])
    for node in net.nodes:
        values = dict(extra.get(node.index, {}))
        if node.index in bootstrap:
            values["p2p.bootstrap"] = [addrs[bootstrap[node.index]]]
        node.home.config.write_text(render(node.home.config.read_text(), values))
    for node in net.nodes:
        node.spawn()
    for node in net.nodes:
        # Ten Python daemons importing libp2p at once on two busy cores take a while.
        node.wait_ready(READY_TIMEOUT_S * 3)


def reach(node: LocalNode) -> dict[str, Any]:
    return node.status()["reachability"]


def peer_entry(node: LocalNode, peer_id: str) -> dict[str, Any] | None:
    return next((p for p in node.get("/v0/peers") if p["peer_id"] == peer_id), None)


def test_node_on_another_network_name_is_dropped(localnet: Callable[..., LocalNet]) -> None:
    net = localnet(3)
    start(net, {1: 0, 2: 0}, {2: {"node.network": "some-other-net"}})
    net.wait_until("node 1 joined node 0", lambda: net.nodes[1].peer_id in net.nodes[0].peer_ids(),
                   timeout=30)
    stranger = net.nodes[2].peer_id
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:  # the stranger keeps redialling its bootstrap peer
        # It may show for an instant as connected, but its hello is never accepted.
        entry = peer_entry(net.nodes[0], stranger)
        assert entry is None or (entry["version"] == "" and entry["addrs"] == [])
        time.sleep(0.3)
    # whichever side reads the other's hello first says why (and hangs up on the other)
    assert any("peer is on another network" in net.nodes[i].log.read_text() for i in (0, 2))
    assert net.nodes[1].peer_id in net.nodes[0].peer_ids()


def test_node_without_the_pre_shared_key_cannot_connect(localnet: Callable[..., LocalNet],
                                                        tmp_path) -> None:  # noqa: ANN001
    key = tmp_path / "swarm.key"
    key.write_text(f"/key/swarm/psk/1.0.0/\n/base16/\n{secrets.token_hex(32)}\n")
    net = localnet(3)
    seed, member, stranger = net.nodes
    start(net, {1: 0, 2: 0}, {0: {"p2p.psk_file": str(key)}, 1: {"p2p.psk_file": str(key)},
                              2: {"node.log_level": "debug"}})  # its failed dials are logged
    net.wait_until("the node with the key joined", lambda: member.peer_id in seed.peer_ids(),
                   timeout=30)
    assert seed.status()["reachability"]["private_network"]
    net.wait_until("the node without the key dialled its bootstrap peer and failed",
                   lambda: any('"event": "dial failed"' in line and seed.peer_id in line
                               for line in stranger.log.read_text().splitlines()), timeout=30)
    assert stranger.peer_id not in seed.peer_ids()
    assert stranger.status()["peers"] == 0


def test_ten_daemons_in_a_chain_find_everyone_through_the_dht_alone(
        localnet: Callable[..., LocalNet]) -> None:
    net = localnet(10, settings={"p2p.peer_exchange": False, "p2p.max_peers": 16})
    start(net, {i: i - 1 for i in range(1, 10)}, {})
    took = net.wait_until("all ten list the other nine", net.fully_connected,
                          timeout=DHT_CHAIN_BOUND_S)
    print(f"10-node chain fully connected through the DHT in {took:.1f} s "
          f"(bound {DHT_CHAIN_BOUND_S:g} s)")
    assert all(reach(n)["dht"] == "server" for n in net.nodes)


# --- a real NAT (netns) ---------------------------------------------------------------

@pytest.fixture
def nat() -> Iterator[Nat]:
    try:
        made = Nat().create()
    except NetnsUnavailable as exc:
        pytest.skip(f"NAT test needs network namespaces: {exc}")
    try:
        yield made
    finally:
        made.destroy()


def test_lan_peers_find_each_other_by_mdns_and_other_networks_do_not(
        nat: Nat, tmp_path: Path) -> None:
    """netns: multicast stays on the test namespace's own link, never the host's LAN."""
    out = nat.python(nat.pub, str(Path(__file__).parent / "netns.py"), "mdns-probe",
                     str(tmp_path), timeout=90)
    result = json.loads(out.strip().splitlines()[-1])
    print(f"netns: mDNS {result}")
    assert result["found"] and result["a_heard"] >= 1
    # py-libp2p's mDNS discovery handler registry is one global per process, so the
    # stranger (in the same probe process) may "hear" the others' events; what must hold
    # is that it never joins them.
    assert result["stranger_peers"] == 0


def spawn_in(nat: Nat, ns: str, node: LocalNode) -> None:
    node.home.clear_admin_address()
    with open(node.log, "ab") as out:
        node.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "kvasird", "--home",
             str(node.home.root), "run"], stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def ns_status(nat: Nat, ns: str, node: LocalNode) -> dict[str, Any]:
    url = node.home.admin_address()
    if url is None:
        raise LocalNetError(f"node {node.index} has no admin address yet (see {node.log})")
    return nat.get(ns, url + "/v0/status")


def ns_peers(nat: Nat, ns: str, node: LocalNode) -> list[dict[str, Any]]:
    return nat.get(ns, node.home.admin_address() + "/v0/peers")


def poll(what: str, predicate: Callable[[], bool], timeout: float) -> float:
    """Poll ``predicate`` (a node that does not answer yet counts as not yet); the seconds it
    took."""
    start = time.monotonic()
    eventually(what, predicate, timeout=timeout, every=0.5,
               not_yet=(LocalNetError, RuntimeError, ValueError, KeyError))
    return time.monotonic() - start


def tcp_reachable(nat: Nat, ns: str, ip: str, port: int) -> bool:
    code = ("import socket, sys\ns = socket.socket(); s.settimeout(3)\n"
            "try:\n    s.connect((sys.argv[1], int(sys.argv[2]))); print('yes')\n"
            "except OSError:\n    print('no')")
    return nat.python(ns, "-c", code, ip, str(port)).strip() == "yes"


def test_node_behind_a_real_nat_is_reached_through_a_relay(
        nat: Nat, localnet: Callable[..., LocalNet], tmp_path: Path) -> None:
    """netns: R and A public, C behind a masquerading NAT; A and a probe reach C via R."""
    net = localnet(3, network="natnet")
    relay, a, c = net.nodes
    where = {relay.index: nat.pub, a.index: nat.pub, c.index: nat.lan}
    ports = {n.index: free_port() for n in net.nodes}
    listen = {relay.index: PUB_IP, a.index: PUB_IP, c.index: LAN_IP}
    ids = {n.index: net.configure(n, []).rsplit("/p2p/", 1)[1] for n in net.nodes}
    relay_addr = f"/ip4/{PUB_IP}/tcp/{ports[relay.index]}/p2p/{ids[relay.index]}"
    extra: dict[int, dict[str, Any]] = {
        relay.index: {},
        # A relays for no one, so the only relay in this network is R.
        a.index: {"p2p.bootstrap": [relay_addr], "p2p.relay_service": "off"},
        # C joins only through R: every other connection to it must come in via R.
        c.index: {"p2p.bootstrap": [relay_addr], "p2p.peer_exchange": False, "p2p.dht": False}}
    for node in net.nodes:
        values = {"p2p.listen": [f"/ip4/{listen[node.index]}/tcp/{ports[node.index]}"],
                  "p2p.reachability_interval_s": 30.0, **extra[node.index]}
        node.home.config.write_text(render(node.home.config.read_text(), values))
        spawn_in(nat, where[node.index], node)
    for node in net.nodes:
        poll(f"node {node.index} is ready", lambda n=node: bool(ns_status(nat, where[n.index], n)),
             READY_TIMEOUT_S)
        node.peer_id = ids[node.index]

    assert not tcp_reachable(nat, nat.pub, LAN_IP, ports[c.index]), "C must not be dialable"
    assert tcp_reachable(nat, nat.lan, PUB_IP, ports[relay.index]), "C must reach out via NAT"

    def c_reach() -> dict[str, Any]:
        return ns_status(nat, nat.lan, c)["reachability"]

    took = poll("C is private and holds a reservation on R",
                lambda: c_reach()["verdict"] == "private"
                and c_reach()["relays"] == [relay.peer_id],
                timeout=60)
    print(f"netns: C private with a reservation on R after {took:.1f} s")
    assert ns_status(nat, nat.pub, relay)["reachability"]["relay_service"] is True

    def a_view_of_c() -> dict[str, Any] | None:
        return next((p for p in ns_peers(nat, nat.pub, a) if p["peer_id"] == c.peer_id), None)

    took = poll("A heartbeats with C through R",
                lambda: (a_view_of_c() or {}).get("rtt_ms") is not None, timeout=60)
    seen = a_view_of_c()
    assert seen is not None
    assert [x for x in seen["addrs"] if "/p2p-circuit/" in x], seen["addrs"]
    assert all(LAN_IP in x or "/p2p-circuit/" in x for x in seen["addrs"])
    print(f"netns: A reached C through R after {took:.1f} s more; heartbeat RTT "
          f"{seen['rtt_ms']:.1f} ms")

    circuit = next(x for x in seen["addrs"] if "/p2p-circuit/" in x)
    probe = nat.python(nat.pub, str(Path(__file__).parent / "netns.py"), "shard-probe",
                       circuit, relay_addr, str(tmp_path), timeout=90)
    result = json.loads(probe.strip().splitlines()[-1])
    print(f"netns: shard protocol through R: {result}")
    assert result["header"]["ok"] is False and "error" in result["header"]


def _routable(node: LocalNode) -> bool:
    import httpx

    url = node.home.admin_address()
    body = {"prompt": [1], "max_tokens": 1}
    return url is not None and httpx.post(url + "/v0/generate", json=body,
                                          timeout=30).status_code == 200


# --- one relayed network for the last tests (kept until the module ends) --------------

@dataclass
class Relayed:
    """R and A public, C private: C announces a dead port, so nobody can dial it directly.

    C dials no one but its relay itself: every other connection must come in via R. C holds
    layers 10-30 and offers no lanes (as behind a NAT that no direct connection crosses), A
    the head and layers 0-10, R nothing. Shared by the tests below, which leave it running.
    """

    net: LocalNet
    reached_s: float
    """How long after C's reservation A was connected to C through R."""


@pytest.fixture(scope="module")
def relayed(module_tmp: Callable[[str], Path]) -> Iterator[Relayed]:
    from test_swarm import settings

    from kvasird.model.bundled import bundled_path

    model = bundled_path()
    net = LocalNet(module_tmp("relayed"), 3)
    relay, a, c = net.nodes
    private = {"p2p.announce": [f"/ip4/127.0.0.1/tcp/{free_port()}"], "p2p.peer_exchange": False,
               "p2p.dht": False, "p2p.relay_reservations": 1, "inference.lanes": False}
    with net:
        start(net, {1: 0, 2: 0}, {0: settings(model, []),
                                  1: settings(model, ["head", "layers:0-10"]),
                                  2: {**settings(model, ["layers:10-30"]), **private}})
        net.wait_until("C finds it is private and holds a reservation on R",
                       lambda: reach(c)["verdict"] == "private"
                       and reach(c)["relays"] == [relay.peer_id],
                       timeout=60)
        took = net.wait_until("A is connected to C and heartbeats flow through R",
                              lambda: (peer_entry(a, c.peer_id) or {}).get("rtt_ms") is not None,
                              timeout=60)
        yield Relayed(net, took)


def test_private_node_is_reached_through_a_relay(relayed: Relayed) -> None:
    relay, a, c = relayed.net.nodes
    assert reach(c)["verdict"] == "private" and reach(c)["relays"] == [relay.peer_id]
    assert reach(relay)["relay_service"] is True
    circuit = reach(c)["circuit_addrs"]
    via_r = f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{c.peer_id}"
    assert circuit and all(via_r in x for x in circuit)
    print(f"A reached C through R {relayed.reached_s:.1f} s after C's reservation")
    seen = peer_entry(a, c.peer_id)
    assert seen is not None and any("/p2p-circuit/" in x for x in seen["addrs"])
    assert seen["rtt_ms"] is not None
    assert reach(a)["verdict"] == "public"
    assert c.peer_id in a.peer_ids() and a.peer_id in c.peer_ids()


def test_a_private_stage_serves_a_ring_through_the_relay(relayed: Relayed) -> None:
    """A's generations run through C, reachable only through R: every stage step goes over
    libp2p through the relay; the tokens equal the engine's own."""
    from test_swarm import PROMPTS, generate

    from kvasird.compute.kv.pool import KVSpec
    from kvasird.compute.stage import Stage
    from kvasird.compute.stage import generate as engine_generate
    from kvasird.model.bundled import bundled_path

    net = relayed.net
    _, a, c = net.nodes
    net.wait_until("A has a route through C", lambda: _routable(a), timeout=60)
    stage = Stage.load(bundled_path(), threads=1, kv=KVSpec(n_slots=512, dtype="f16"))
    try:
        want = engine_generate(stage, PROMPTS[0], 12)
    finally:
        stage.close()
    assert generate(a, PROMPTS[0]) == want
    seen = peer_entry(a, c.peer_id)
    assert seen is not None and any("/p2p-circuit/" in x for x in seen["addrs"])
    assert a.get("/v0/inference")["lanes"]["open_to"] == []

"""Goodbyes that peers hear, and joins that get the coverage map (#37, finding 6).

Real `kvasird run` processes on 127.0.0.1, each on its own home made by `kvasird init` and
joined by its bootstrap peer's address, as a user builds a network. kvasird.toml gets
loopback ports, the model and a memory budget, nothing else: the market runs on its
default timings, so a record lives the TTL a user's network gives it. A adds the bundled
model; B and C join and serve it by its id, whose manifest they fetch from their peers.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvasird.config import MarketConfig, render
from kvasird.home import Home
from kvasird.localnet.launcher import LocalNode, free_port
from kvasird.market.publish import record_ttl
from tests.support import eventually

pytestmark = pytest.mark.slow

KVASIRD = [sys.executable, "-m", "kvasird"]
NETWORK = "goodbyes"
GOODBYE_BOUND_S = 5.0
"""A node stopped by SIGTERM leaves its peers' maps within this (the issue's bound)."""
TTL_S = record_ttl(MarketConfig().heartbeat_s, 3)
"""What a killed node's record lives in a three-node market on the default timings."""
SERVE_TIMEOUT_S = 240.0
"""Three Python daemons on a busy two-core machine: importing, splitting and loading a
model among them."""


class Daemon:
    """One node: a home made by `kvasird init`, run as `kvasird run`."""

    def __init__(self, root: Path, name: str, model: str, budget_mb: int,
                 bootstrap: str | None = None) -> None:
        self.name = name
        home = root / name
        kvasird("--home", str(home), "init", "--network", NETWORK,
                *(["--bootstrap", bootstrap] if bootstrap else []))
        config = home / "kvasird.toml"
        config.write_text(render(config.read_text(), {
            "p2p.listen": [f"/ip4/127.0.0.1/tcp/{free_port()}"], "p2p.mdns": False,
            "admin.listen": "127.0.0.1:0", "gateway.listen": "127.0.0.1:0",
            "market.model": model, "market.memory_budget_mb": budget_mb}))
        self.node = LocalNode(0, Home(home), log=root / f"{name}.log")

    def start(self) -> None:
        self.node.start()

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    def coverage(self) -> dict[str, Any]:
        """`kvasird coverage --json`, from the admin API it prints."""
        return self.node.get("/v0/coverage")

    def holders(self) -> set[str]:
        return set(self.coverage().get("holders") or {})

    def gateway(self, method: str, path: str, body: Any = None) -> httpx.Response:
        url = self.node.status()["gateway"]
        return httpx.request(method, url + path, json=body, timeout=120)

    def serves(self) -> bool:
        return self.gateway("GET", "/health").status_code == 200

    def route_now(self) -> list[str]:
        hops = self.gateway("GET", "/status").json()["gateway"]["route_now"] or []
        return [hop["peer"] for hop in hops]

    def chat(self) -> str:
        model = self.gateway("GET", "/v1/models").json()["data"][0]["id"]
        r = self.gateway("POST", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def events(self, event: str) -> list[dict[str, Any]]:
        """The log's events named ``event`` (the daemon logs JSON lines off a terminal)."""
        out = []
        for line in self.node.log.read_text(errors="replace").splitlines():
            try:
                parsed = json.loads(line)
            except ValueError:
                continue
            if isinstance(parsed, dict) and parsed.get("event") == event:
                out.append(parsed)
        return out


def kvasird(*args: str) -> str:
    return subprocess.run([*KVASIRD, *args], check=True, capture_output=True, text=True,
                          timeout=120).stdout


def wait_until(what: str, predicate: Callable[[], Any], timeout: float,
               daemons: list[Daemon]) -> float:
    """Poll ``predicate`` until truthy; return the seconds it took, or fail with the logs."""
    start = time.monotonic()
    eventually(what, predicate, timeout=timeout, not_yet=(httpx.HTTPError, KeyError),
               context=lambda: "\n".join(f"--- {d.name} ---\n{d.node.tail(40)}"
                                         for d in daemons))
    return time.monotonic() - start


@pytest.fixture(scope="module")
def network(module_tmp: Callable[[str], Path]) -> Iterator[list[Daemon]]:
    """A serving the bundled model, then B and C joining it one after the other."""
    root = module_tmp("goodbye")
    a = Daemon(root, "a", "bundled:smollm2", 64)
    daemons = [a]
    try:
        a.start()
        # as a user joins a running node: one that has told the network about itself
        wait_until("A's record is out", lambda: a.peer_id in a.holders(), 120, daemons)
        model_id = a.coverage()["model"]["id"]
        for name, budget in (("b", 128), ("c", 64)):
            joining = Daemon(root, name, model_id, budget, bootstrap=a.node.join_addr)
            daemons.append(joining)
            joining.start()
            wait_until(f"{name} holds units", lambda d=joining: d.coverage()["held"] and
                       d.coverage()["state"] == "online", SERVE_TIMEOUT_S, daemons)
        wait_until("A's map lists B and C, and A's gateway serves",
                   lambda: {d.peer_id for d in daemons[1:]} <= a.holders() and a.serves(),
                   SERVE_TIMEOUT_S, daemons)
        yield daemons
    finally:
        for d in daemons:
            d.node.stop()


def test_each_joining_node_maps_its_bootstrap_peers_records_and_enrolls_at_the_first_try(
        network: list[Daemon]) -> None:
    for joined in network[1:]:
        fetched = joined.events("fetched the coverage map from a peer")
        assert fetched and fetched[0]["records"] > 0, fetched
        assert joined.events("enrolling")
        assert not joined.events("could not obtain or load enrolled units; giving them up")


def test_a_node_stopped_by_sigterm_leaves_its_peers_at_once_and_a_killed_one_by_its_ttl(
        network: list[Daemon]) -> None:
    a, b, c = network
    c.node.signal(signal.SIGTERM)
    took = wait_until("A's and B's maps no longer list C",
                      lambda: all(c.peer_id not in d.holders() for d in (a, b)), 30, network)
    print(f"C left its peers' maps {took:.2f} s after SIGTERM (its TTL: {TTL_S:g} s)")
    assert took < GOODBYE_BOUND_S
    wait_until("A's and B's peer lists no longer list C",
               lambda: all(c.peer_id not in d.node.peer_ids() for d in (a, b)),
               GOODBYE_BOUND_S - took, network)
    coverage = json.loads(kvasird("--home", str(a.node.home.root), "coverage", "--json"))
    assert c.peer_id not in coverage["holders"]
    assert c.node.proc is not None and c.node.proc.wait(30) == 0
    assert c.peer_id not in a.route_now()
    assert a.chat()

    b.node.signal(signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < 2 * GOODBYE_BOUND_S:  # no goodbye: A keeps it
        assert b.peer_id in a.holders()
        time.sleep(0.2)
    took = wait_until("A's map drops B when its record's TTL runs out",
                      lambda: b.peer_id not in a.holders(), TTL_S + 30, network)
    print(f"B left A's map {2 * GOODBYE_BOUND_S + took:.1f} s after kill -9")

"""Running several nodes by hand, as the README says: homes made with `kvasird init` and its
flags (no localnet wiring), real `kvasird run` processes on 127.0.0.1, the CLI against them.

Each test reproduces one thing an operator ran into (issue #37, "running it is fiddly"):
ports to edit for a second node, `bootstrap add` that needed a restart, a status without the
model, gateway, health or earnings, "fully covered: no" for a lone node serving fine, an
error logged on every join, a wrong bootstrap address that logged dozens of errors and no
reason, and "ready" printed before the model could be served.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvasird.config import load, render
from kvasird.home import Home
from kvasird.localnet.launcher import LocalNode, die_with_parent, free_port
from kvasird_dev.testmodels import make_model
from tests.support import STARTING, eventually

pytestmark = pytest.mark.slow

KVASIRD = [sys.executable, "-m", "kvasird"]
WAIT_S = 120.0
QUICK = {"p2p.mdns": False, "market.heartbeat_s": 1.0, "market.rebalance_s": 2.0,
         "market.enroll_delay_s": 0.0, "compute.threads": 1}
"""What the operator edits here: no LAN discovery (the nodes must join by their bootstrap
lists alone) and a market that decides in seconds."""
NOT_LISTENING = "/ip4/127.0.0.1/tcp/{port}/p2p/{peer}"


def kvasird(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*KVASIRD, "--home", str(home), *args], capture_output=True,
                          text=True, timeout=180)
    assert not check or done.returncode == 0, f"kvasird {' '.join(args)}: {done.stderr}"
    return done


def port_base() -> int:
    """A port N with N..N+3 free on loopback (what `init --port-base` takes)."""
    for _ in range(50):
        base = free_port()
        try:
            for port in range(base, base + 4):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no four consecutive free loopback ports")


def init(home: Path, *flags: str) -> str:
    """`kvasird init` with ``flags``, the operator's QUICK edits; the node's peer id."""
    kvasird(home, "init", "--listen", "127.0.0.1", *flags)
    config = home / "kvasird.toml"
    config.write_text(render(config.read_text(), QUICK))
    return kvasird(home, "id").stdout.split()[0]


def wait_until(what: str, predicate: Callable[[], Any], nodes: list[LocalNode],
               timeout: float = WAIT_S) -> Any:
    """The first truthy value of ``predicate``; the failure carries the nodes' log ends."""
    return eventually(what, predicate, timeout=timeout, every=0.2, not_yet=STARTING,
                      context=lambda: "\n".join(f"--- node {n.index}\n{n.tail(40)}"
                                                for n in nodes))


def logged(node: LocalNode) -> list[dict[str, Any]]:
    """The node's log events (its stderr and stdout are JSON lines off a terminal)."""
    return [json.loads(line) for line in node.log.read_text().splitlines() if line.strip()]


# --- nodes with no model: joining, bootstrap dials, their logs ------------------------------


@dataclass
class Swarm:
    a: LocalNode
    """The first node; ports from --port-base."""
    b: LocalNode
    """The second node on the same machine: --port-base and --bootstrap A, nothing edited."""
    c: LocalNode
    """A node whose bootstrap list names A at a port nobody listens on, and A's address with
    another node's peer id."""
    base: dict[str, int] = field(default_factory=dict)
    """Each node's --port-base."""
    wrong_port: str = ""
    wrong_peer: str = ""


@pytest.fixture(scope="module")
def swarm(module_tmp: Callable[[str], Path]) -> Iterator[Swarm]:
    root = module_tmp("by-hand")
    base = {name: port_base() for name in "abc"}
    a_id = init(root / "a", "--port-base", str(base["a"]))
    a_join = f"/ip4/127.0.0.1/tcp/{base['a']}/p2p/{a_id}"
    init(root / "b", "--port-base", str(base["b"]), "--bootstrap", a_join)
    other = init(root / "never-started")
    wrong_port = NOT_LISTENING.format(port=free_port(), peer=a_id)
    wrong_peer = f"/ip4/127.0.0.1/tcp/{base['a']}/p2p/{other}"
    init(root / "c", "--port-base", str(base["c"]), "--bootstrap", wrong_port,
         "--bootstrap", wrong_peer)
    nodes = [LocalNode(i, Home(root / n), log=root / f"{n}.log") for i, n in enumerate("abc")]
    try:
        for node in nodes:
            node.start()
        yield Swarm(*nodes, base=base, wrong_port=wrong_port, wrong_peer=wrong_peer)
    finally:
        for node in nodes:
            node.stop()


def test_a_second_node_on_one_machine_needs_only_a_port_base(swarm: Swarm) -> None:
    a, b = swarm.a, swarm.b
    wait_until("B joined A by its bootstrap address", lambda: a.peer_id in b.peer_ids(), [a, b])
    base = swarm.base["b"]
    status = b.status()
    assert status["gateway"] == f"http://127.0.0.1:{base + 1}"
    assert b.home.admin_address() == f"http://127.0.0.1:{base + 2}"
    assert sorted(status["listen_addrs"]) == sorted(
        [f"/ip4/127.0.0.1/tcp/{base}/p2p/{b.peer_id}",
         f"/ip4/127.0.0.1/tcp/{base + 3}/ws/p2p/{b.peer_id}"])


def test_two_nodes_joining_log_no_error(swarm: Swarm) -> None:
    """Every join used to log "[error] fail to upgrade mux": the peer's reachability probe
    hangs up after the security handshake, which py-libp2p logs as an error."""
    a, b = swarm.a, swarm.b
    wait_until("both nodes checked that the other can dial them back",
               lambda: all(n.status()["reachability"]["verdict"] == "public" for n in (a, b)),
               [a, b])
    for node in (a, b):
        errors = [e for e in logged(node) if e.get("level") in ("error", "critical")]
        assert errors == [], errors


def test_an_unreachable_bootstrap_peer_is_one_warning_that_says_why(swarm: Swarm) -> None:
    """A wrong port used to log ~28 error lines (four per try, from py-libp2p) and no
    reason; a wrong peer id only "handshake failed"."""
    c = swarm.c
    wait_until("C has been up for 12 s (its dialer retried each peer several times)",
               lambda: c.status()["uptime_s"] >= 12, [c])
    events = logged(c)
    assert [e for e in events if e.get("level") in ("error", "critical")] == []
    warned = [e for e in events if e.get("level") == "warning"
              and e["event"].startswith("cannot reach bootstrap peer")]
    by_peer = {e["peer"]: e["event"] for e in warned}
    assert len(warned) == len(by_peer) == 2, warned
    assert "connection refused" in by_peer[swarm.wrong_port.rsplit("/", 1)[1]]
    assert "peer id did not match" in by_peer[swarm.wrong_peer.rsplit("/", 1)[1]]


def test_bootstrap_add_dials_a_running_daemon_at_once(swarm: Swarm) -> None:
    a, c = swarm.a, swarm.c
    refused = kvasird(c.home.root, "bootstrap", "add",
                      NOT_LISTENING.format(port=free_port(), peer=a.peer_id), check=False)
    assert refused.returncode == 1 and "connection refused" in refused.stdout, refused.stdout
    joined = kvasird(c.home.root, "bootstrap", "add", a.join_addr)
    assert f"connected to {a.peer_id}" in joined.stdout
    wait_until("C lists A as a peer, without a restart", lambda: a.peer_id in c.peer_ids(),
               [a, c], timeout=20)
    assert a.join_addr in load(c.home.config).p2p.bootstrap


# --- a lone node serving a model ----------------------------------------------------------


@dataclass
class Lone:
    node: LocalNode
    model: Path
    shown: list[str]
    """What the daemon printed on its terminal, line by line."""
    health_at_ready: int
    """The gateway's /health status code when "ready" was printed."""


@pytest.fixture(scope="module")
def lone(module_tmp: Callable[[str], Path]) -> Iterator[Lone]:
    """One node made with `init --model FILE --budget 100M`, run on a terminal (a pty)."""
    root = module_tmp("lone")
    model = make_model(root / "model.gguf", arch="qwen3", n_layer=2, dtype="q8_0")
    home = root / "home"
    init(home, "--port-base", str(port_base()), "--model", str(model), "--budget", "100M")
    node = LocalNode(0, Home(home), log=root / "unused.log")
    leader, follower = os.openpty()
    shown: list[str] = []
    node.proc = subprocess.Popen([*KVASIRD, "--home", str(home), "run"], stdin=subprocess.DEVNULL,
                                 stdout=follower, stderr=follower, preexec_fn=die_with_parent)
    os.close(follower)
    reader = threading.Thread(target=_read_lines, args=(leader, shown), daemon=True)
    reader.start()
    try:
        wait_until("the daemon prints ready", lambda: any(_is_ready(s) for s in shown), [node])
        gateway = f"http://{load(home / 'kvasird.toml').gateway.listen}"
        health = httpx.get(f"{gateway}/health", timeout=10).status_code
        node.peer_id = node.status()["peer_id"]
        yield Lone(node, model, shown, health)
    finally:
        node.stop()
        reader.join(10)
        os.close(leader)


def serving(node: LocalNode) -> None:
    wait_until("the gateway serves", lambda: httpx.get(
        f"http://{load(node.home.config).gateway.listen}/health", timeout=5).status_code == 200,
        [node])


def _read_lines(fd: int, into: list[str]) -> None:
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the daemon exited and closed the terminal
            return
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        into.extend(re.sub(r"\x1b\[[0-9;]*m", "", line.decode(errors="replace")).rstrip("\r")
                    for line in lines)


def _is_ready(line: str) -> bool:
    return line == "ready" or line.startswith("ready ")


def test_on_a_terminal_ready_is_printed_only_once_the_gateway_serves(lone: Lone) -> None:
    assert lone.health_at_ready == 200
    ready = next(i for i, line in enumerate(lone.shown) if _is_ready(line))
    banner = next(i for i, line in enumerate(lone.shown) if line.startswith("peer id"))
    waiting = [line for line in lone.shown[banner:ready] if line.startswith("waiting ")]
    assert waiting, lone.shown  # what it waited for, before ready


def test_status_shows_model_role_gateway_health_peers_and_earnings(lone: Lone) -> None:
    serving(lone.node)
    home = lone.node.home.root
    status = json.loads(kvasird(home, "status", "--json").stdout)
    assert status["model"]["id"] and status["model"]["name"]
    assert status["role"]["units"]  # the whole model: it is alone
    assert status["health"] == {"status": "ok", "reason": status["health"]["reason"]}
    rows = {line[:12].strip(): line[13:] for line in kvasird(home, "status").stdout.splitlines()}
    assert status["model"]["id"] in rows["model"] and status["model"]["name"] in rows["model"]
    assert rows["role"].startswith(f"holds {len(status['role']['units'])} unit")
    assert rows["gateway"] == status["gateway"]
    assert rows["health"].startswith("ok: ")
    assert rows["peers"] == "0"
    assert "earnings" in rows


def test_coverage_of_a_lone_node_serving_the_whole_model_says_it_is_served(lone: Lone) -> None:
    serving(lone.node)
    shown = kvasird(lone.node.home.root, "coverage").stdout
    assert "fully covered: no" not in shown
    assert "served: yes" in shown, shown

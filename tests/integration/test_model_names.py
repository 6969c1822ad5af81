"""One name for a model across the network. A model its owner named (`kvasird model add
FILE --name NAME`) is that name where users see it: the gateway's /v1/models and its
status, and requests may name it so; the content id stays underneath and is accepted too.
Nodes set up by hand (`kvasird init`, no localnet wiring) that get the model from their
peers, by its name, its id or a prefix of the id, call it what its holder does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvasird.config import render
from kvasird.home import Home
from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LocalNode, free_port
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest
from kvasird_dev.testmodels import make_model
from tests.support import STARTING, eventually

pytestmark = pytest.mark.slow

NAME = "qwen3.6:35b-a3b"


@pytest.mark.parametrize("local", [True, False], ids=["whole model in the gateway", "ring"])
def test_the_name_given_at_model_add_is_what_the_gateway_serves(tmp_path: Path,
                                                                 local: bool) -> None:
    path = make_model(tmp_path / "model.gguf", arch="qwen3", n_layer=2, dtype="q8_0")
    model_id = Manifest.from_gguf(path).model_id
    net = LocalNet(tmp_path / "net", 1, settings={
        "market.model": str(path), "market.memory_budget_mb": 100, "market.target_replicas": 1,
        "market.heartbeat_s": 1.0, "market.enroll_delay_s": 0.0, "compute.threads": 1,
        "gateway.local": local})
    with net:
        node = net.nodes[0]
        net.configure(node, [])
        subprocess.run([sys.executable, "-m", "kvasird", "--home", str(node.home.root), "model",
                        "add", str(path), "--name", NAME], check=True, capture_output=True,
                       timeout=120)
        node.spawn()
        node.wait_ready()
        net.wait_until("the gateway answers", lambda: httpx.get(
            node.status()["gateway"] + "/health", timeout=5).status_code == 200, 120)
        url = node.status()["gateway"]
        listed = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["model_id"], m["name"]) for m in listed] == [(NAME, model_id, NAME)]
        for asked in (NAME, model_id):
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": asked, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text


# --- a network set up by hand: homes made with `kvasird init`, no localnet wiring -------

SMOLLM2 = "smollm2:135m-instruct"
KVASIRD = [sys.executable, "-m", "kvasird"]
WAIT_S = 240.0
FAST = {"p2p.mdns": False, "p2p.heartbeat_interval_s": 1.0, "p2p.liveness_timeout_s": 5.0,
        "market.heartbeat_s": 1.0, "market.rebalance_s": 2.0, "market.enroll_delay_s": 0.0,
        "market.target_replicas": 1, "compute.threads": 1, "admin.listen": "127.0.0.1:0",
        "gateway.listen": "127.0.0.1:0"}
"""On loopback, and quick: a test waits seconds where a real network waits minutes."""


def kvasird(home: Path, *args: str) -> str:
    done = subprocess.run([*KVASIRD, "--home", str(home), *args], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, f"kvasird {' '.join(args)}: {done.stderr}"
    return done.stdout


@pytest.fixture
def hand_built(tmp_path: Path) -> Iterator[Callable[..., LocalNode]]:
    """Start a node the way a person does: `kvasird init` (joining ``bootstrap``), its
    kvasird.toml edited, `kvasird run`; every node started is stopped afterwards."""
    nodes: list[LocalNode] = []

    def start(bootstrap: str = "", before: Callable[[Path], None] = lambda home: None,
              **settings: Any) -> LocalNode:
        home = tmp_path / f"node{len(nodes)}"
        kvasird(home, "init", "--network", "names",
                *(["--bootstrap", bootstrap] if bootstrap else []))
        config = home / "kvasird.toml"
        values = {**FAST, "p2p.listen": [f"/ip4/127.0.0.1/tcp/{free_port()}"],
                  **{key.replace("__", "."): value for key, value in settings.items()}}
        config.write_text(render(config.read_text(), values))
        before(home)
        node = LocalNode(len(nodes), Home(home), log=tmp_path / f"node{len(nodes)}.log")
        nodes.append(node)
        node.start()
        return node

    yield start
    for node in nodes:
        node.stop()


def listed(node: LocalNode) -> list[tuple[str, str]]:
    """(id, model_id) of each model the node's gateway lists."""
    data = httpx.get(node.status()["gateway"] + "/v1/models", timeout=10).json()["data"]
    return [(m["id"], m["model_id"]) for m in data]


def ready(node: LocalNode) -> bool:
    return httpx.get(node.status()["gateway"] + "/health", timeout=5).status_code == 200


def wait_until(what: str, predicate: Callable[[], bool], nodes: list[LocalNode]) -> None:
    """Poll ``predicate``; the failure carries the nodes' log ends."""
    eventually(what, predicate, timeout=WAIT_S, every=0.5, not_yet=STARTING,
               context=lambda: "\n".join(f"--- node {n.index}\n{n.tail(40)}" for n in nodes))


def banner_model(node: LocalNode) -> str:
    """The model the node's startup banner names (printed, or its JSON event's field)."""
    for line in node.log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            if m := re.match(r"model +(\S+)$", line):
                return m[1]
            continue
        if isinstance(event, dict) and event.get("event") == "banner" and event.get("model"):
            return str(event["model"])
    raise AssertionError(f"node {node.index}'s banner names no model:\n{node.tail(40)}")


def test_nodes_set_up_by_hand_call_the_model_by_one_name(
        hand_built: Callable[..., LocalNode]) -> None:
    """A adds the bundled GGUF; B asks for the model by its name, C by its id, D by a
    16-hex-digit prefix of it (C and D hold nothing): all four list it by one name, a chat
    naming it works on B, and the name A's owner gives it later is the name everywhere. E
    asks for a name no peer announces: it waits, and its /health says for what."""
    a = hand_built(before=lambda home: kvasird(home, "model", "add", "bundled:smollm2"),
                   market__model="bundled:smollm2", market__memory_budget_mb=400)
    model_id = Manifest.from_gguf(bundled_path()).model_id
    assert banner_model(a) == SMOLLM2
    b = hand_built(a.join_addr, market__model=SMOLLM2, market__memory_budget_mb=100,
                   market__hold=["head"])
    c = hand_built(a.join_addr, market__model=model_id)
    d = hand_built(a.join_addr, market__model=model_id[:16])
    e = hand_built(a.join_addr, market__model="nobody:here")
    nodes = [a, b, c, d, e]
    wait_until("every node lists the model as smollm2:135m-instruct",
               lambda: all(listed(n) == [(SMOLLM2, model_id)] for n in nodes[:4]), nodes)
    health = httpx.get(e.status()["gateway"] + "/health", timeout=10)
    assert health.status_code == 503 and "nobody:here" in health.json()["reason"]
    assert "waiting for a peer's record naming the model" in e.log.read_text()
    assert listed(e) == []
    found = httpx.get(f"{c.status()['gateway']}/v1/models/{banner_model(a)}", timeout=10)
    assert found.status_code == 200 and found.json()["model_id"] == model_id
    for node in (b, c):  # B holds the head, C nothing: A's banner's request works on both
        wait_until(f"node {node.index}'s gateway is ready", partial(ready, node), nodes)
        r = httpx.post(node.status()["gateway"] + "/v1/chat/completions", timeout=120, json={
            "model": banner_model(a), "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == SMOLLM2
    shown = kvasird(b.home.root, "coverage", "--model", SMOLLM2)
    assert shown.startswith(f"model {SMOLLM2} (id {model_id[:16]}")

    kvasird(a.home.root, "model", "add", str(bundled_path()), "--name", "tiny:q3")
    wait_until("every node lists the model as tiny:q3, the name A's owner gave it",
               lambda: all(listed(n) == [("tiny:q3", model_id)] for n in nodes[:4]), nodes)
    assert json.loads(kvasird(b.home.root, "model", "list", "--json"))[0]["name"] == "tiny:q3"

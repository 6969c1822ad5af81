"""Settlement from the RPC URL alone, as a network built by hand uses it: homes made with
`kvasird init`, a `kvasird localchain` started on its own, and kvasird.toml naming only the
chain's URL. The chain names its mint; a gateway is funded by `kvasird wallet faucet
--stake`; a chain that cannot name its mint stops a node before it joins."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from handbuilt import kvasird, wait_until  # type: ignore[import-not-found]

from kvasird.cli import main
from kvasird.config import render
from kvasird.home import Home
from kvasird.localnet.launcher import LocalNode, die_with_parent, free_port
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest

KVASIRD = [sys.executable, "-m", "kvasird"]
QUICK_P2P = {"p2p.mdns": False, "p2p.heartbeat_interval_s": 1.0,
             "p2p.liveness_timeout_s": 5.0, "p2p.peer_exchange_interval_s": 1.0}
"""Loopback only, and heartbeats a loopback network can afford."""


@contextmanager
def local_chain(data: Path, port: int = 0) -> Iterator[dict[str, str]]:
    """`kvasird localchain` on its own, on loopback; what it printed ("RPC URL", ...)."""
    proc = subprocess.Popen([*KVASIRD, "localchain", "--data", str(data), "--listen",
                             f"127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        info: dict[str, str] = {}
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded: the chain prints "ready" or exits
            if line.startswith("Local chain is ready"):
                break
            key, _, value = line.partition("  ")
            info[key.strip()] = value.strip()
        assert "RPC URL" in info, f"the local chain did not start: {info}"
        yield info
    finally:
        proc.terminate()
        proc.wait(10)


def hand_built(home: Path, rpc_url: str, *, bootstrap: str = "",
               **settings: Any) -> tuple[LocalNode, str]:
    """A node as the README builds it: `kvasird init`, then kvasird.toml edited to take
    payments on the chain at ``rpc_url`` (nothing else about the chain) with a new wallet.
    Returns the node (not started) and its join address."""
    out = kvasird("--home", str(home), "init",
                  *(["--bootstrap", bootstrap] if bootstrap else [])).stdout
    peer_id = re.search(r"peer id\s+(\S+)", out)
    assert peer_id, out
    port = free_port()
    config = home / "kvasird.toml"
    config.write_text(render(config.read_text(), {
        **QUICK_P2P, "p2p.listen": [f"/ip4/127.0.0.1/tcp/{port}"],
        "admin.listen": "127.0.0.1:0", "gateway.listen": "127.0.0.1:0",
        "settlement.enabled": True, "settlement.rpc_url": rpc_url,
        "settlement.wallet": "wallet.json", **settings}))
    kvasird("--home", str(home), "wallet", "new")
    node = LocalNode(0, Home(home), log=home / "kvasird.log")
    return node, f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id.group(1)}"


@contextmanager
def cluster() -> Iterator[str]:
    """A JSON-RPC endpoint that answers like a Solana cluster to kvasird's local-only
    methods: there is no such method (it cannot name a mint, and has no KVR faucet)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            rid = json.loads(self.rfile.read(int(self.headers["content-length"])))["id"]
            body = json.dumps({"jsonrpc": "2.0", "id": rid, "error": {
                "code": -32601, "message": "Method not found"}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(10)


@pytest.mark.slow
def test_nodes_given_only_the_chains_url_settle_and_a_faucet_staked_gateway_serves(
        tmp_path: Path) -> None:
    model = bundled_path()
    manifest = Manifest.from_gguf(model)
    budget_mb = int(manifest.total_bytes * 1.35 / 2 / 2**20) + 1  # together: once, not alone
    market = {"market.memory_budget_mb": budget_mb, "market.target_replicas": 1,
              "market.heartbeat_s": 1.0, "market.rebalance_s": 2.0,
              "market.enroll_delay_s": 1.0, "compute.threads": 1}
    with local_chain(tmp_path / "chain") as chain:
        rpc = chain["RPC URL"]
        a, join_a = hand_built(tmp_path / "a", rpc, **market, **{"market.model": "bundled:smollm2"})
        b, _ = hand_built(tmp_path / "b", rpc, bootstrap=join_a,
                          **market, **{"market.model": manifest.model_id})
        for node in (a, b):
            text = (node.home.config).read_text()
            assert 'kvr_mint = ""' in text and 'genesis_wallet = ""' in text
        funded = kvasird("--home", str(a.home.root), "wallet", "faucet", "--stake").stdout
        assert "100000.000000 KVR, which the peers check on chain" in funded, funded
        assert re.search(r"funded \S+: 101000\.000000 KVR", funded), funded
        shown = kvasird("--home", str(a.home.root), "wallet").stdout
        assert re.search(rf"KVR mint\s+{chain['KVR mint']}", shown), shown
        try:
            for node in (a, b):
                node.spawn()
            for node in (a, b):
                node.wait_ready(120)
            url = a.status()["gateway"]
            quote = httpx.post(f"{url}/v1/kvasir/quote", json={"max_tokens": 1},
                               timeout=30).json()
            assert quote["mint"] == chain["KVR mint"]  # the daemon settles on the chain's mint
            wait_until("the model is covered and the gateway on A is ready",
                       lambda: a.get("/v0/coverage")["routable"] and httpx.get(
                           f"{url}/health", timeout=5).status_code == 200, 300)
            answer = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": manifest.model_id, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Name a colour."}]})
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvasir-paid-by"] == f"operator {a.wallet()}"
            wait_until("B holds A's receipt for its work", lambda: any(
                g["earned"] > 0 for g in b.get("/v0/wallet")["gateways"]), 60)
            assert a.get("/v0/wallet")["own_use"]["requests"] == 1
        finally:
            for node in (a, b):
                node.stop()


def test_a_node_whose_chain_cannot_name_its_mint_stops_before_it_joins(
        tmp_path: Path) -> None:
    peer = socket.create_server(("127.0.0.1", 0))  # its bootstrap peer: is it ever dialled?
    peer.setblocking(False)
    bootstrap = (f"/ip4/127.0.0.1/tcp/{peer.getsockname()[1]}"
                 "/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo")
    with cluster() as url, peer:
        node, _ = hand_built(tmp_path / "node", url, bootstrap=bootstrap)
        node.spawn()
        assert node.proc is not None
        try:
            status = node.proc.wait(60)
        finally:
            node.stop()
        log = node.log.read_text()
        assert status != 0, log
        assert (f"the chain at {url} does not name its KVR mint and genesis wallet (only a "
                "kvasird local chain does): set [settlement] kvr_mint and genesis_wallet in "
                f"{node.home.config} to your network's") in log.splitlines()[-1], log
        assert "ready" not in log
        with pytest.raises(BlockingIOError):
            peer.accept()  # the node never dialled its bootstrap peer: it did not join


def test_a_node_started_before_its_chain_waits_for_it(tmp_path: Path) -> None:
    port = free_port()
    node, _ = hand_built(tmp_path / "node", f"http://127.0.0.1:{port}")
    node.spawn()
    try:
        wait_until("the node says it waits for its chain",
                   lambda: "waiting for the chain" in node.log.read_text(), 60)
        assert node.alive() and node.home.admin_address() is None
        with local_chain(tmp_path / "chain", port):
            node.wait_ready(60)
            assert node.stop() == 0
    finally:
        node.stop()


def test_a_chain_that_is_not_local_has_no_faucet_and_is_asked_for_no_mint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = ["--home", str(tmp_path)]
    assert main([*home, "wallet", "new"]) == 0
    with cluster() as url:
        assert main([*home, "wallet", "--rpc", url, "faucet", "--stake"]) == 1
        refused = capsys.readouterr().err
        assert f"{url} is not a kvasird local chain: it has no faucet" in refused, refused
        assert main([*home, "wallet", "--rpc", url]) == 1
        refused = capsys.readouterr().err
        assert "does not name its KVR mint" in refused and "--mint" in refused, refused

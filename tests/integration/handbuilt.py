"""A network built the way a user builds one, with no launcher: a ``kvasird localchain`` in
its own process, homes made with ``kvasird init``, each kvasird.toml edited (ports, the
chain's RPC URL, mint and genesis wallet written out, the model), wallets made with
``kvasird wallet new`` and funded with ``kvasird wallet faucet``, daemons started with
``kvasird run``. Every command is the CLI's, run as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvasird.config import render
from kvasird.home import Home
from kvasird.localnet.launcher import LocalChainProcess, LocalNode, free_port
from tests.support import STARTING, eventually

NETWORK = "handbuilt"
STAKE_KVR = 101_000
"""What a gateway's operator funds its wallet with: the network's stake minimum and some."""


def kvasird(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``kvasird ARGS`` as a user types it; fails the test (with its output) on an error."""
    done = subprocess.run([sys.executable, "-m", "kvasird", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"kvasird {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


@dataclass
class HandBuilt:
    """The chain and the nodes, all stopped by ``down``."""

    root: Path
    chain: LocalChainProcess
    nodes: list[LocalNode] = field(default_factory=list)

    @property
    def rpc(self) -> str:
        return self.chain.info["RPC URL"]

    def add_node(self, bootstrap: str = "", stake_kvr: float = 1, **settings: Any) -> LocalNode:
        """``kvasird init`` a home, edit its kvasird.toml (``settings``: the model, what it
        holds, ...), make and fund its wallet, run it."""
        index = len(self.nodes)
        home = Home(self.root / f"node{index}")
        kvasird("--home", str(home.root), "init", "--network", NETWORK,
                *(["--bootstrap", bootstrap] if bootstrap else []))
        values = {"p2p.listen": [f"/ip4/127.0.0.1/tcp/{free_port()}"], "p2p.mdns": False,
                  "admin.listen": "127.0.0.1:0", "gateway.listen": f"127.0.0.1:{free_port()}",
                  "compute.threads": 1, "settlement.enabled": True,
                  "settlement.rpc_url": self.rpc,
                  "settlement.kvr_mint": self.chain.info["KVR mint"],
                  "settlement.genesis_wallet": self.chain.info["genesis wallet"],
                  "settlement.wallet": "wallet.json", **settings}
        home.config.write_text(render(home.config.read_text(), values))
        kvasird("--home", str(home.root), "wallet", "new")
        kvasird("--home", str(home.root), "wallet", "faucet", "--kvr", str(stake_kvr))
        node = LocalNode(index, home, log=self.root / f"node{index}.log")
        self.nodes.append(node)
        node.start()
        return node

    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        wait_until(what, predicate, timeout, lambda: "\n".join(
            f"--- node {n.index}\n{n.tail()}" for n in self.nodes))

    def down(self) -> None:
        for node in self.nodes:
            node.stop()
        self.chain.stop()


def wait_until(what: str, predicate: Callable[[], bool], timeout: float,
               tails: Callable[[], str] = lambda: "") -> None:
    """Poll until ``predicate`` holds (a refused connection or a missing field counts as
    not yet); past ``timeout`` fail, with ``tails()`` (the nodes' log ends) in the message."""
    eventually(what, predicate, timeout=timeout, every=0.3, not_yet=STARTING, context=tails)


def hand_built(root: Path) -> HandBuilt:
    """The local chain, started as ``kvasird localchain`` (its RPC URL, mint and genesis
    wallet read from what it prints)."""
    root.mkdir(parents=True, exist_ok=True)
    chain = LocalChainProcess(root / "chain", root / "chain.log")
    chain.start()
    return HandBuilt(root, chain)

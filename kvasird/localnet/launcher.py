"""Starting and stopping daemons as real processes, with bounded waits and full cleanup."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from kvasird.config import render
from kvasird.daemon.init import init_home
from kvasird.errors import KvasirError
from kvasird.home import Home
from kvasird.identity import load_node_key
from kvasird.settlement.chain import ChainClient
from kvasird.settlement.localchain.faucet import OWN_USE
from kvasird.settlement.pricing import GENESIS_STAKE_MIN
from kvasird.settlement.wallet import read_keypair, write_keypair

READY_TIMEOUT_S = 60.0
"""How long a started daemon may take to answer its admin API (a bound, not a wait: ready
is seen within 0.1 s). A loaded 2-core machine took over 30 s to start one (imports, the
model's import and check) while the suite's other worker ran daemons too."""
STOP_TIMEOUT_S = 10.0
# A loopback network can afford fast heartbeats: dead peers vanish within ~6 s.
LOCAL_P2P = {
    "p2p.heartbeat_interval_s": 1.0,
    "p2p.liveness_timeout_s": 5.0,
    "p2p.peer_exchange_interval_s": 1.0,
    # Loopback networks must not find each other (or the LAN) by multicast.
    "p2p.mdns": False,
}


class LocalNetError(KvasirError):
    """A local daemon did not start or stop as expected; its log path is in the message."""


@dataclass
class LocalNode:
    index: int
    """Position in the chain (node i bootstraps from node i-1)."""
    home: Home
    """The node's own state directory."""
    proc: subprocess.Popen[bytes] | None = None
    """The running `kvasird run` process."""
    peer_id: str = ""
    """Known once the node is ready."""
    join_addr: str = ""
    """Its TCP join address (ends in /p2p/<peer id>)."""
    log: Path = field(default=Path())
    """stdout+stderr of the process."""
    command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "kvasird"])
    """The program that `--home HOME run` is given to: kvasird itself, or a test's fault
    layer in front of it."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Config values for this node only, over the network's settings."""
    stake: int | None = None
    """KVR base units its wallet gets from the local faucet when settlement is on (None: the
    network's stake minimum, so that it may run a gateway, and OWN_USE to spend)."""

    def get(self, path: str, timeout: float = 5.0) -> Any:
        url = self.home.admin_address()
        if url is None:
            raise LocalNetError(f"node {self.index} has no admin API address (see {self.log})")
        return httpx.get(url + path, timeout=timeout).json()

    def status(self) -> dict[str, Any]:
        return self.get("/v0/status")

    def post(self, path: str, timeout: float = 120.0) -> Any:
        url = self.home.admin_address()
        if url is None:
            raise LocalNetError(f"node {self.index} has no admin API address (see {self.log})")
        return httpx.post(url + path, timeout=timeout).json()

    def wallet(self) -> Pubkey:
        """The node's wallet (its gateway vault and payout address)."""
        return read_keypair(self.home.root / "wallet.json").pubkey()

    def peer_ids(self) -> set[str]:
        return {p["peer_id"] for p in self.get("/v0/peers")}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, ready_timeout: float = READY_TIMEOUT_S) -> None:
        self.spawn()
        self.wait_ready(ready_timeout)

    def spawn(self, outlive_parent: bool = False) -> None:
        """Start the daemon; it dies with this process unless ``outlive_parent`` (--detach)."""
        self.home.clear_admin_address()
        out = open(self.log, "ab")  # noqa: SIM115 - handed to the child process
        self.proc = subprocess.Popen(
            [*self.command, "--home", str(self.home.root), "run"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=None if outlive_parent else die_with_parent,
        )
        out.close()

    def wait_ready(self, ready_timeout: float = READY_TIMEOUT_S) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LocalNetError(
                    f"node {self.index} exited with status {self.proc.returncode} "
                    f"before it was ready; its log: {self.log}\n{self.tail()}"
                )
            if self.home.admin_address():
                try:
                    status = self.status()
                except httpx.HTTPError:
                    pass
                else:
                    self.peer_id, self.join_addr = status["peer_id"], status["join_addr"]
                    return
            time.sleep(0.1)
        self.stop()
        raise LocalNetError(
            f"node {self.index} was not ready within {ready_timeout:g} s; "
            f"its log: {self.log}\n{self.tail()}"
        )

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait, then SIGKILL; return the exit status."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


@dataclass
class LocalChainProcess:
    """`kvasird localchain` as a process: the one chain every node of a local network uses."""

    data: Path
    """Its data directory (genesis keys, accounts, transactions)."""
    log: Path
    """Its stdout+stderr."""
    proc: subprocess.Popen[bytes] | None = None
    """The running process."""
    info: dict[str, str] = field(default_factory=dict)
    """What it printed: "RPC URL", "KVR mint", "genesis wallet"."""
    outlive_parent: bool = False
    """Keep running when the launcher exits (--detach)."""

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        # The log keeps earlier runs' output: only what this run appends says it is ready
        # (an earlier run's "ready" and its RPC URL, a dead port now, were taken for it).
        begin = self.log.stat().st_size if self.log.exists() else 0
        out = open(self.log, "ab")  # noqa: SIM115 - handed to the child process
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvasird",
                "localchain",
                "--data",
                str(self.data),
                "--listen",
                "127.0.0.1:0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=None if self.outlive_parent else die_with_parent,
        )
        out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log, "rb") as log:
                log.seek(begin)
                text = log.read().decode(errors="replace")
            if "Local chain is ready" in text:
                for line in text.splitlines():
                    key, _, value = line.partition("  ")
                    if value.strip():
                        self.info[key.strip()] = value.strip()
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise LocalNetError(f"the local chain did not start; its log: {self.log}")

    def settings(self) -> dict[str, Any]:
        return {
            "settlement.enabled": True,
            "settlement.rpc_url": self.info["RPC URL"],
            "settlement.kvr_mint": self.info["KVR mint"],
            "settlement.genesis_wallet": self.info["genesis wallet"],
            "settlement.commitment": "confirmed",
        }

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def die_with_parent() -> None:
    """In the child: SIGTERM when the launcher dies, even by SIGKILL (Linux prctl).

    A test or a demo that is killed must not leave daemons behind.
    """
    with contextlib.suppress(OSError):  # no glibc here: no parent-death signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port for a daemon's config, free now and unlikely to be taken before
    the daemon binds it.

    Ports are written into a config before the daemon starts, so the kernel's own choice
    (bind to port 0) is unsafe: a daemon started meanwhile may get the same port for one of
    its port-0 listeners (admin API, lanes, a chain's RPC), and then one of the two never
    listens (seen: a ring whose gateway lost its TCP port to a peer's WebSocket listener).
    So ports come from below the kernel's ephemeral range, at random, never twice from one
    process. Processes that start networks side by side (parallel test workers) each take
    their own part of that range: ``KVASIR_PORT_SHARE="K/N"`` gives the K-th of N parts.
    """
    low, high = _ephemeral_range()
    lo, hi = (20000, low - 1) if low > 21000 else (high + 1, 65535)
    lo, hi = _share(lo, hi, os.environ.get("KVASIR_PORT_SHARE", ""))
    for _ in range(200):
        port = random.randint(lo, hi)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise LocalNetError(f"no free loopback port in {lo}-{hi} after 200 tries")


def _share(lo: int, hi: int, share: str) -> tuple[int, int]:
    """Part K of N (``share`` = "K/N", 0 <= K < N) of the ports lo..hi; all of them if unset."""
    if not share:
        return lo, hi
    try:
        k, n = (int(v) for v in share.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        raise LocalNetError(
            f"KVASIR_PORT_SHARE={share!r}: write K/N with 0 <= K < N, e.g. 0/2"
        ) from None
    size = (hi - lo + 1) // n
    return lo + k * size, lo + (k + 1) * size - 1


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (
            int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        )
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


class LocalNet:
    """N daemons on loopback under ``root``; use as a context manager to always clean up."""

    def __init__(
        self,
        root: Path,
        n: int,
        network: str = "localnet",
        settings: dict[str, Any] | None = None,
        chain: bool = False,
        outlive_parent: bool = False,
    ) -> None:
        self.root = root
        self.network = network
        self.settings = {**LOCAL_P2P, **(settings or {})}
        self.outlive_parent = outlive_parent
        """Leave the processes running when this launcher exits (--detach)."""
        self.chain = (
            LocalChainProcess(root / "chain", root / "chain.log", outlive_parent=outlive_parent)
            if chain
            else None
        )
        self.nodes = [
            LocalNode(i, Home(root / f"node{i}"), log=root / f"node{i}.log") for i in range(n)
        ]

    def __enter__(self) -> LocalNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def configure(self, node: LocalNode, bootstrap: list[str]) -> str:
        """Init the node's home (or update an existing one, same key); return its join address.

        Ports are chosen here, so every join address is known before any node starts
        and the whole network can start at once.
        """
        port, ws_port = free_port(), free_port()
        values = {
            "node.network": self.network,
            "p2p.listen": [f"/ip4/127.0.0.1/tcp/{port}", f"/ip4/127.0.0.1/tcp/{ws_port}/ws"],
            "p2p.bootstrap": bootstrap,
            "admin.listen": "127.0.0.1:0",
            "gateway.listen": "127.0.0.1:0",
            **self.settings,
            **node.settings,
        }
        if values.get("settlement.enabled"):
            values["settlement.wallet"] = "wallet.json"
        if node.home.node_key.exists():
            node.home.config.write_text(render(node.home.config.read_text(), values))
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            init_home(node.home, values)
        if values.get("settlement.enabled") and not (node.home.root / "wallet.json").exists():
            write_keypair(node.home.root / "wallet.json", Keypair())  # the node's gateway vault
        return f"/ip4/127.0.0.1/tcp/{port}/p2p/{load_node_key(node.home.node_key).peer_id}"

    def up(self) -> None:
        """Start every node at once, joined in a chain: node i bootstraps from node i-1."""
        self.start_chain()
        previous = ""
        for node in self.nodes:
            previous = self.configure(node, [previous] if previous else [])
        self.fund_wallets()
        for node in self.nodes:
            node.spawn(self.outlive_parent)
        for node in self.nodes:
            node.wait_ready()
        self.write_state()

    def start_chain(self) -> None:
        """Start the local chain (if this network has one); the nodes' settings point at it."""
        if self.chain is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self.chain.start()
            self.settings = {**self.settings, **self.chain.settings()}

    def fund_wallets(self) -> None:
        """Every configured node's wallet gets SOL for fees and its stake in KVR (faucet);
        nodes with settlement off have none."""
        if self.chain is not None:
            trio.run(self._fund_wallets)

    async def _fund_wallets(self) -> None:
        assert self.chain is not None
        async with ChainClient(self.chain.info["RPC URL"], "confirmed") as chain:
            for node in self.nodes:
                if not (node.home.root / "wallet.json").exists():
                    continue  # settlement off on this node
                stake = GENESIS_STAKE_MIN + OWN_USE if node.stake is None else node.stake
                await chain.faucet(node.wallet(), kvr=stake, lamports=10**9)

    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float) -> float:
        """Poll ``predicate`` until true; return seconds taken; fail naming ``what``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                if predicate():
                    return time.monotonic() - start
            except (httpx.HTTPError, LocalNetError, ValueError):
                pass
            time.sleep(0.2)
        raise LocalNetError(
            f"timed out after {timeout:g} s waiting until {what}; logs in {self.root}"
        )

    def fully_connected(self) -> bool:
        live = [n for n in self.nodes if n.alive()]
        ids = {n.peer_id for n in live}
        return all(n.peer_ids() == ids - {n.peer_id} for n in live)

    def down(self) -> dict[int, int | None]:
        """Stop every node (all drain at once), then the chain; return exit statuses."""
        for node in self.nodes:
            node.signal(signal.SIGTERM)
        codes = {n.index: n.stop() for n in reversed(self.nodes)}
        if self.chain is not None:
            self.chain.stop()
        (self.root / "localnet.json").unlink(missing_ok=True)
        return codes

    def write_state(self) -> None:
        chain = self.chain.proc.pid if self.chain is not None and self.chain.proc else None
        state = {
            "network": self.network,
            "chain_pid": chain,
            "nodes": [
                {
                    "index": n.index,
                    "home": str(n.home.root),
                    "pid": n.proc.pid if n.proc else None,
                    "peer_id": n.peer_id,
                    "log": str(n.log),
                }
                for n in self.nodes
            ],
        }
        (self.root / "localnet.json").write_text(json.dumps(state, indent=2))

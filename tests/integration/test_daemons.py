"""Several real `kvasird run` processes on 127.0.0.1."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LOCAL_P2P

pytestmark = pytest.mark.slow

# heartbeat 1 s + liveness 5 s: a dead peer must be gone within 6 s; allow for a busy CI box.
LIVENESS_BOUND_S = LOCAL_P2P["p2p.liveness_timeout_s"] + LOCAL_P2P["p2p.heartbeat_interval_s"]


def test_five_daemons_joined_in_a_chain_all_see_each_other(localnet: Callable[..., LocalNet]) -> None:
    net = localnet(5)
    net.up()
    took = net.wait_until("all five list the other four", net.fully_connected, timeout=40)
    print(f"five daemons in a chain fully connected {took:.1f} s after all were ready")
    for node in net.nodes:
        status = node.status()
        assert status["peers"] == 4
        assert {"peer_id", "network", "listen_addrs", "peers", "uptime_s", "version"} <= set(status)
        for peer in node.get("/v0/peers"):
            assert {"peer_id", "addrs", "connected_since", "last_seen"} <= set(peer)


def test_killed_daemon_disappears_from_peer_lists_within_the_liveness_bound(
        localnet: Callable[..., LocalNet]) -> None:
    net = localnet(3)
    net.up()
    net.wait_until("all three are connected", net.fully_connected, timeout=30)
    victim = net.nodes[1]
    victim.signal(signal.SIGKILL)
    took = net.wait_until(
        "the killed node is gone from both survivors' peer lists",
        lambda: all(victim.peer_id not in n.peer_ids() for n in (net.nodes[0], net.nodes[2])),
        timeout=LIVENESS_BOUND_S + 10)
    print(f"killed peer dropped after {took:.1f} s (bound {LIVENESS_BOUND_S:g} s)")
    assert took <= LIVENESS_BOUND_S + 3


def test_frozen_daemon_is_dropped_by_the_heartbeat_timeout(localnet: Callable[..., LocalNet]) -> None:
    """SIGSTOP keeps its sockets open but silent: only the liveness timeout can notice."""
    net = localnet(3)
    net.up()
    net.wait_until("all three are connected", net.fully_connected, timeout=30)
    victim = net.nodes[1]
    victim.signal(signal.SIGSTOP)
    try:
        took = net.wait_until(
            "the frozen node is gone from both survivors' peer lists",
            lambda: all(victim.peer_id not in n.peer_ids() for n in (net.nodes[0], net.nodes[2])),
            timeout=LIVENESS_BOUND_S + 10)
    finally:
        victim.signal(signal.SIGCONT)
    print(f"frozen peer dropped after {took:.1f} s (bound {LIVENESS_BOUND_S:g} s)")
    assert LOCAL_P2P["p2p.liveness_timeout_s"] - 1 <= took <= LIVENESS_BOUND_S + 3


def test_sigterm_exits_zero_quickly_and_restart_keeps_the_peer_id(
        localnet: Callable[..., LocalNet]) -> None:
    net = localnet(2)
    net.up()
    net.wait_until("both are connected", net.fully_connected, timeout=30)
    node = net.nodes[1]
    peer_id = node.peer_id
    start = time.monotonic()
    assert node.stop(timeout=10) == 0
    assert time.monotonic() - start < 10
    assert not node.home.admin_file.exists()
    # The survivor hears the stream end at once instead of waiting out the timeout.
    net.wait_until("the stopped node is gone", lambda: peer_id not in net.nodes[0].peer_ids(),
                   timeout=LIVENESS_BOUND_S)
    node.start()
    assert node.peer_id == peer_id
    net.wait_until("the restarted node rejoined", net.fully_connected, timeout=30)


def test_invalid_config_gives_a_clear_error_and_no_daemon(localnet: Callable[..., LocalNet]) -> None:
    net = localnet(1)
    node = net.nodes[0]
    net.configure(node, [])
    node.home.config.write_text(node.home.config.read_text().replace(
        "liveness_timeout_s = 5.0", "liveness_timeout_s = -1"))
    done = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(node.home.root), "run"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "p2p.liveness_timeout_s = -1 is out of range" in done.stderr
    assert str(node.home.config) in done.stderr
    node.home.config.write_text("[p2p\n")
    done = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(node.home.root), "run"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "not valid TOML" in done.stderr


async def _try_connect(addr: str, security: str) -> bool:
    key = create_new_key_pair()
    sec = ({NOISE_ID: NoiseTransport(key, noise_privkey=new_x25519().private_key)}
           if security == "noise" else {PLAINTEXT_PROTOCOL_ID: InsecureTransport(key)})
    host = new_host(key_pair=key, sec_opt=sec, muxer_preference="YAMUX")
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        with trio.move_on_after(10):
            try:
                await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                return True
            except Exception:  # noqa: BLE001 - any failure to connect is the expected outcome
                return False
    return False


def test_plaintext_peer_cannot_connect_but_a_noise_peer_can(localnet: Callable[..., LocalNet]) -> None:
    net = localnet(1)
    net.up()
    addr = net.nodes[0].join_addr
    assert trio.run(_try_connect, addr, "plaintext") is False
    assert trio.run(_try_connect, addr, "noise") is True


def test_localnet_command_starts_three_daemons_that_see_each_other(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvasird", "localnet", "up", "--nodes", "3", "--once",
         "--model", "none", "--dir", str(tmp_path / "ln")],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("node") and "12D3" in line]
    assert len(lines) == 3
    for i, line in enumerate(lines):
        others = {f"node{j}" for j in range(3)} - {f"node{i}"}
        assert set(line.split(None, 2)[2].split(", ")) == others
    assert "stopped 3 daemons" in done.stdout

"""`kvasird localnet down` stops every process `localnet up --detach` left running."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvasird.localnet import LocalNet
from tests.support import eventually

pytestmark = pytest.mark.slow


def test_down_stops_the_local_chain_too(tmp_path: Path) -> None:
    """The chain alone (stopping the daemons is older and tested with them)."""
    net = LocalNet(tmp_path / "ln", 0, chain=True)
    with net:
        net.up()  # writes localnet.json, as `up --detach` does
        assert net.chain is not None and net.chain.proc is not None
        done = subprocess.run([sys.executable, "-m", "kvasird", "localnet", "down", "--dir",
                               str(tmp_path / "ln")], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "and the local chain" in done.stdout
        eventually("the local chain stops", lambda: net.chain.proc.poll() is not None,
                   timeout=15)


def test_a_local_chain_started_again_in_the_same_folder_reads_its_own_address(
        tmp_path: Path) -> None:
    """The chain's log keeps earlier runs' output: a second start in the same folder (a
    hobbyist's second `localnet up`) takes the address this run prints, not the last
    run's, whose port is dead now."""
    root = tmp_path / "ln"
    root.mkdir()
    (root / "chain.log").write_text("RPC URL         http://127.0.0.1:1\nLocal chain is ready\n")
    net = LocalNet(root, 0, chain=True)
    with net:
        net.up()
        assert net.chain is not None
        url = net.chain.info["RPC URL"]
        assert url != "http://127.0.0.1:1"
        done = subprocess.run([sys.executable, "-m", "kvasird", "wallet", "--rpc", url,
                               "--address", net.chain.info["genesis wallet"]],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr  # the chain answers at that address

"""`kvasird localnet down` stops every process `localnet up --detach` left running."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvasird.localnet import LocalNet

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
        deadline = time.monotonic() + 15
        while net.chain.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert net.chain.proc.poll() is not None, "the local chain still runs"

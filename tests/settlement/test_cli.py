"""``kvasird localchain`` and ``kvasird wallet`` as an operator runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvasird.cli import main


@pytest.fixture
def running_chain(tmp_path: Path) -> Iterator[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvasird",
            "--home",
            str(tmp_path),
            "localchain",
            "--listen",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "ready" in line:
                break
        url = re.search(r"RPC URL\s+(\S+)", "".join(lines))
        assert url, lines
        yield url.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.slow
def test_wallet_shows_balances_after_faucet_on_a_standalone_local_chain(
    running_chain: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = ["--home", str(tmp_path)]
    assert main([*home, "wallet", "new"]) == 0
    assert main([*home, "wallet", "--rpc", running_chain, "faucet", "--kvr", "12.5"]) == 0
    capsys.readouterr()
    assert main([*home, "wallet", "--rpc", running_chain]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"KVR\s+12\.500000", shown) and re.search(r"SOL\s+1\.0", shown)


def test_wallet_against_unreachable_rpc_says_what_to_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = ["--home", str(tmp_path)]
    assert main([*home, "wallet", "new"]) == 0
    assert main([*home, "wallet", "--rpc", "http://127.0.0.1:9"]) == 1
    assert "check that it is reachable" in capsys.readouterr().err

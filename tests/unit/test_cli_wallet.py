"""``kvasird wallet`` on a node's home: the chain and mint come from its [settlement]."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvasird.cli import main
from kvasird.config import render


@pytest.fixture
def chain_url(tmp_path: Path) -> Iterator[str]:
    """A standalone local chain on a free loopback port (never 8899: the default must not
    be what makes the test pass)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvasird", "localchain", "--data",
                             str(tmp_path / "chain"), "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        seen = ""
        while "ready" not in seen and (line := proc.stdout.readline()):
            seen += line
        found = re.search(r"RPC URL\s+(\S+)", seen)
        assert found, seen
        assert not found.group(1).endswith(":8899")
        yield found.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.slow
def test_wallet_uses_the_configured_rpc_url(
        chain_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    assert main(["--home", str(home), "init"]) == 0
    config = home / "kvasird.toml"
    config.write_text(render(config.read_text(), {"settlement.rpc_url": chain_url}))
    assert main(["--home", str(home), "wallet", "new"]) == 0
    assert main(["--home", str(home), "wallet", "faucet", "--kvr", "7"]) == 0
    capsys.readouterr()
    assert main(["--home", str(home), "wallet"]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"KVR\s+7\.000000", shown) and re.search(r"SOL\s+1\.0", shown), shown


def test_wallet_new_writes_the_configured_keypair_file(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--home", str(tmp_path), "init"]) == 0
    config = tmp_path / "kvasird.toml"
    config.write_text(render(config.read_text(), {"settlement.wallet": "operator.json"}))
    capsys.readouterr()
    assert main(["--home", str(tmp_path), "wallet", "new"]) == 0
    assert f"keypair  {tmp_path / 'operator.json'}" in capsys.readouterr().out
    assert not (tmp_path / "wallet.json").exists()


def test_wallet_new_for_a_keypair_in_a_missing_directory_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "nowhere" / "w.json"
    assert main(["wallet", "--keypair", str(target), "new"]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert f"{target.parent} does not exist" in line
    assert not target.parent.exists()


def test_wallet_with_an_address_needs_no_home(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An address and an RPC URL are all it takes; the missing home is not created."""
    address = "11111111111111111111111111111111"
    rc = main(["--home", str(tmp_path / "none"), "wallet", "--address", address,
               "--rpc", "http://127.0.0.1:9", "--mint", address])
    assert rc == 1
    assert "127.0.0.1:9" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()

"""The CLI answers fast because it loads only what the command needs: `--version`, `status`
and `peers` (which only talk to the daemon's admin API) load no libp2p, numpy, chain client
or ggml. Checked by what a fresh interpreter has imported, not by timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvasird.localnet import LocalNet

HEAVY = ("libp2p", "multiaddr", "numpy", "solana", "solders", "spl", "ggml", "gguf",
         "tokenizers", "trio", "httpx", "starlette", "hypercorn", "cryptography")

DRIVER = """
import json, os, sys
from kvasird.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
loaded = sorted({name.split(".")[0] for name in sys.modules})
with open(os.environ["LOADED_OUT"], "w") as f:
    json.dump({"rc": rc, "loaded": loaded}, f)
"""


def run_cli(tmp_path: Path, *args: str) -> tuple[int, str, set[str]]:
    """(exit status, stdout, top-level packages loaded) of ``kvasird ARGS`` in a fresh process."""
    out = tmp_path / "loaded.json"
    done = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "LOADED_OUT": str(out)})
    result = json.loads(out.read_text())
    return result["rc"], done.stdout, set(result["loaded"]) & set(HEAVY)


def test_version_loads_nothing_heavy(tmp_path: Path) -> None:
    rc, out, heavy = run_cli(tmp_path, "--version")
    assert (rc, out.strip(), heavy) == (0, "kvasird 0.1.0", set())


@pytest.fixture(scope="module")
def node(module_tmp: Callable[[str], Path]) -> Iterator[LocalNet]:
    with LocalNet(module_tmp("net"), 1,
                  settings={"gateway.enabled": False}) as net:
        net.up()
        yield net


@pytest.mark.slow
@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["peers"],
                                     ["peers", "--json"]])
def test_daemon_queries_load_nothing_heavy(node: LocalNet, command: list[str],
                                           tmp_path: Path) -> None:
    home = str(node.nodes[0].home.root)
    rc, out, heavy = run_cli(tmp_path, *command, "--home", home)
    assert (rc, heavy) == (0, set())
    if command == ["status", "--json"]:
        assert json.loads(out)["peer_id"] == node.nodes[0].peer_id
    elif command == ["status"]:
        assert f"peer id      {node.nodes[0].peer_id}" in out
    elif command == ["peers", "--json"]:
        assert json.loads(out) == []
    else:
        assert out.startswith("no peers (yet)")

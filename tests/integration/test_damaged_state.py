"""A daemon started on damaged state or config stops with one line that says what to do.

Each case is a real `kvasird run` process on a home made by `kvasird init`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from kvasird.daemon.init import init_home
from kvasird.db import connect, ensure_schema
from kvasird.home import Home
from kvasird_dev.testmodels import make_model, save

pytestmark = pytest.mark.slow

LOOPBACK = {"p2p.listen": ["/ip4/127.0.0.1/tcp/0"], "p2p.dht": False, "p2p.mdns": False,
            "admin.listen": "127.0.0.1:0", "gateway.listen": "127.0.0.1:0",
            "inference.lanes": False}
RUN_S = 120.0
"""How long a refusing daemon may take to start and refuse (a busy 2-core machine)."""


def _home(tmp_path: Path, **values: object) -> Home:
    home = Home(tmp_path / "home")
    init_home(home, {**LOOPBACK, **values})
    return home


def _refusal(home: Home) -> str:
    """The one line a `kvasird run` that must refuse prints; it exits 1 without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "kvasird", "--home", str(home.root), "run"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.startswith("kvasird: ")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def _fill(path: Path) -> None:
    """Receipts and peers a node would keep: enough rows to span many pages."""
    conn = connect(path)
    ensure_schema(conn, "CREATE TABLE IF NOT EXISTS kept (k TEXT PRIMARY KEY, v TEXT);")
    with conn:
        conn.executemany("INSERT INTO kept VALUES (?, ?)",
                         [(f"k{i}", "v" * 300) for i in range(1000)])
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def test_a_half_truncated_state_db_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _fill(home.db)
    data = home.db.read_bytes()
    home.db.write_bytes(data[:len(data) // 2])
    line = _refusal(home)
    assert f"{home.db} is damaged" in line and "backup" in line and "move it aside" in line
    assert home.db.stat().st_size == len(data) // 2  # left as it was, for the operator


def test_an_empty_state_db_is_not_taken_for_a_new_one(tmp_path: Path) -> None:
    home = _home(tmp_path)
    home.db.write_bytes(b"")
    line = _refusal(home)
    assert f"{home.db} is damaged (0 bytes)" in line and "receipts" in line
    assert home.db.stat().st_size == 0


def test_a_config_cut_before_p2p_is_refused_not_run_on_defaults(tmp_path: Path) -> None:
    home = _home(tmp_path)
    text = home.config.read_text()
    home.config.write_text(text[:text.index("[p2p]")])
    line = _refusal(home)
    assert f"{home.config} was cut short" in line


def test_a_config_cut_mid_line_names_the_line(tmp_path: Path) -> None:
    home = _home(tmp_path)
    text = home.config.read_text()
    at = text.index('listen = ["') + len('listen = ["/ip4/12')
    home.config.write_text(text[:at])
    line = _refusal(home)
    assert f"line {text[:at].count(chr(10)) + 1}" in line


def test_pins_larger_than_the_budget_are_refused_at_start(tmp_path: Path) -> None:
    model = make_model(tmp_path / "dense.gguf", arch="llama", n_layer=4, n_embd=256,
                       n_ff=1024, dtype="f32")  # layers of 3.2 MiB
    home = _home(tmp_path, **{"market.model": str(model), "market.hold": ["layers:0-4"],
                              "market.memory_budget_mb": 1, "inference.serve": False})
    line = _refusal(home)
    assert "[market] hold pins 4 units that need 12.8 MB" in line and "memory_budget_mb = 1" in line
    assert "set memory_budget_mb to at least" in line


def test_pins_outside_the_model_are_refused_at_start(tmp_path: Path) -> None:
    model = make_model(tmp_path / "dense.gguf", arch="llama", n_layer=2, dtype="f32")
    home = _home(tmp_path, **{"market.model": str(model), "market.hold": ["layers:0-3"],
                              "market.memory_budget_mb": 100, "inference.serve": False})
    line = _refusal(home)
    assert "[market] hold names layer:2, which the model lacks (2 layers" in line


def test_a_model_file_that_is_no_gguf_is_refused_before_ready(tmp_path: Path) -> None:
    """It used to print the banner and "ready" (and would tell systemd READY=1), then exit
    once the import read the file."""
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"\x00" * 4096)
    home = _home(tmp_path, **{"market.model": str(bad), "market.memory_budget_mb": 100})
    proc = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(home.root), "run"],
                          capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"kvasird: {bad} is not a GGUF file (bad magic)"
    assert '"ready"' not in proc.stderr and "ready" not in proc.stdout


def foreign_model(path: Path) -> Path:
    """A GGUF of an architecture the engine does not serve (phi3), as such a file starts."""
    writer = GGUFWriter(str(path), "phi3")
    writer.add_uint32("phi3.block_count", 1)
    writer.add_uint32("phi3.embedding_length", 8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    return save(writer, path)


def test_a_model_of_an_architecture_not_served_is_refused_at_start(tmp_path: Path) -> None:
    model = foreign_model(tmp_path / "phi3.gguf")
    home = _home(tmp_path, **{"market.model": str(model), "market.memory_budget_mb": 100})
    line = _refusal(home)
    assert f"{model}: architecture 'phi3' is not supported (supported: llama," in line
    assert "qwen35moe" in line
    done = subprocess.run([sys.executable, "-m", "kvasird", "--home", str(tmp_path / "h2"),
                           "model", "add", str(model)], capture_output=True, text=True,
                          timeout=RUN_S)
    assert done.returncode == 1 and "architecture 'phi3' is not supported" in done.stderr

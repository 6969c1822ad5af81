from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvasird.cli import main
from kvasird.cli.service import render_unit
from kvasird.daemon import systemd

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "kvasird.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_that_service_install_writes_verifies(tmp_path: Path) -> None:
    # The unit `kvasird service install` writes points at this installation's kvasird,
    # which systemd-analyze checks exists.
    unit = tmp_path / "kvasird.service"
    unit.write_text(render_unit("kvasird", str(Path(sys.prefix) / "bin" / "kvasird")))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    problems = [line for line in done.stderr.splitlines() if "kvasird.service" in line]
    assert done.returncode == 0 and not problems, done.stderr


def test_unit_is_notify_type_and_hardened() -> None:
    text = UNIT.read_text()
    for line in ("Type=notify", "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                 "StateDirectory=kvasird", "User=kvasird", "WatchdogSec="):
        assert line in text


def test_sd_notify_sends_to_the_notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert systemd.notify("READY=1")
        assert server.recv(100) == b"READY=1"


def test_sd_notify_is_a_no_op_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False


def test_watchdog_interval_is_half_the_period(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval_s() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert systemd.watchdog_interval_s() is None


def test_service_install_dry_run_shows_unit_and_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service", "install", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"ExecStart={Path(sys.prefix) / 'bin' / 'kvasird'} run" in out
    assert "useradd --system" in out and "systemctl enable kvasird --now" in out

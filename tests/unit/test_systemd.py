from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvasird.cli import main
from kvasird.cli.service import installation, render_unit, unreachable_by_service
from kvasird.config import load
from kvasird.daemon import systemd

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "kvasird.service"
EXPOSURE_BOUND = 13
"""systemd-analyze security's overall exposure, times ten: 1.3 (1.4 before the unit allowed
AF_NETLINK and gained PrivateMounts=)."""


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


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_exposure_is_no_worse_than_before(tmp_path: Path) -> None:
    # The daemon itself runs under this unit's sandbox in tests/integration/test_unit_sandbox.py.
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes",
                           f"--threshold={EXPOSURE_BOUND}", str(UNIT)],
                          capture_output=True, text=True)
    if "--offline" in done.stderr and "unrecognized" in done.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    overall = [line for line in done.stdout.splitlines() if "Overall exposure" in line]
    assert done.returncode == 0, overall or done.stderr


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
    # As root with ProtectHome=read-only the service reaches any installation.
    assert main(["service", "install", "--dry-run", "--user", "root",
                 "--protect-home", "read-only"]) == 0
    out = capsys.readouterr().out
    assert f"ExecStart={Path(sys.prefix) / 'bin' / 'kvasird'} run" in out
    assert "\nProtectHome=read-only\n" in out and "\nUser=root\n" in out
    assert "useradd --system" in out and "systemctl enable kvasird --now --no-block" in out
    assert "net.ipv4.tcp_slow_start_after_idle = 0\n" in out
    assert "sysctl -q -p /etc/sysctl.d/60-kvasird.conf" in out
    assert main(["service", "install", "--dry-run", "--user", "root",
                 "--protect-home", "read-only", "--no-sysctl"]) == 0
    assert "sysctl" not in capsys.readouterr().out


def test_a_python_linked_into_a_home_is_refused_under_protect_home(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    python.symlink_to("/home/alice/.pyenv/versions/3.11.7/bin/python3.11")
    unit = render_unit("kvasird", str(tmp_path / "venv" / "bin" / "kvasird"))
    why = unreachable_by_service(unit, {"its python": python})
    assert why == (
        f"the service could not start: its python ({python} -> /home/alice/.pyenv/versions/"
        "3.11.7/bin/python3.11) is in /home, which ProtectHome=yes hides from it; install "
        "kvasird under /opt with a python outside any home directory (e.g. /usr/bin/python3 "
        "-m venv /opt/kvasird/.venv), or rerun with --protect-home read-only")
    assert unreachable_by_service(render_unit("kvasird", "/opt/k", "read-only"),
                                  {"its python": python}) is None


def test_an_installation_its_user_may_not_enter_is_refused(tmp_path: Path) -> None:
    private = tmp_path / "private"
    (private / "bin").mkdir(parents=True)
    private.chmod(0o700)
    unit = render_unit("kvasird", "/opt/k", "read-only")
    why = unreachable_by_service(unit, {"kvasird": private / "bin" / "kvasird"})
    assert why is not None and "which user kvasird may not enter; install kvasird under /opt" in why
    assert unreachable_by_service(render_unit("root", "/opt/k", "read-only"),
                                  {"kvasird": private / "bin" / "kvasird"}) is None


def test_service_install_dry_run_shows_what_would_stop_the_install_and_succeeds(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run used to exit 1, "the service could not start", without trying anything."""
    runs = installation()
    why = unreachable_by_service(render_unit("kvasird", str(runs["kvasird"])), runs)
    assert main(["service", "install", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# would run: systemctl daemon-reload" in out
    assert (why is None) == ("would refuse to install" not in out)
    assert why is None or f"# but it would refuse to install: {why}" in out


def test_the_units_first_start_inits_the_home_with_the_options_given_at_install(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its ExecStartPre= ran a bare `kvasird init`: no model, no bootstrap, default ports."""
    peer = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWESNwYUkewwdrtKoRqtf8HD43B1fEcnjCzBuQyw2qh5av"
    assert main(["service", "install", "--dry-run", "--user", "root", "--protect-home",
                 "read-only", "--model", "bundled:smollm2", "--budget", "1GiB", "--port-base",
                 "4100", "--bootstrap", peer]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("ExecStartPre=")]
    home = tmp_path / "state"
    argv = shlex.split(line.removeprefix("ExecStartPre=").replace("/var/lib/kvasird", str(home)))
    done = subprocess.run(argv, env={**os.environ, "KVASIRD_HOME": str(home)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    config = load(home / "kvasird.toml")
    assert (config.market.model, config.market.memory_budget_mb) == ("bundled:smollm2", 1024)
    assert config.p2p.bootstrap == (peer,)
    assert (config.gateway.listen, config.admin.listen) == ("127.0.0.1:4101", "127.0.0.1:4102")


def test_service_install_refuses_options_the_first_start_would_fail_on(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service", "install", "--dry-run", "--bootstrap", "/ip4/1.2.3.4/tcp/1"]) == 1
    assert "lacks /p2p/<peer id>" in capsys.readouterr().err

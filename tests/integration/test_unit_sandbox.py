"""The daemon as systemd runs it from systemd/kvasird.service, under the unit's own sandbox.

There is no systemd PID 1 to start the unit here, so sandbox.py loads the seccomp filters
systemd makes of the unit's SystemCallFilter=, SystemCallErrorNumber=,
RestrictAddressFamilies=, RestrictNamespaces=, SystemCallArchitectures= and
NoNewPrivileges= (each read from the unit) and execs its ExecStartPre= and ExecStart= with
its Environment=, this installation's kvasird in place of /opt's and the state directory in
a temporary one. The socket in $NOTIFY_SOCKET is the test's, as systemd's would be.

KVASIRD_UNIT=FILE runs the tests on another unit, e.g. the one before the fix (they fail):
    git show 0876251:systemd/kvasird.service > /tmp/old.service
    KVASIRD_UNIT=/tmp/old.service .venv/bin/python -m pytest tests/integration/test_unit_sandbox.py
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sandbox import ANALYZE, NotifySocket, Unit, launcher  # type: ignore[import-not-found]

from kvasird.cli.service import TEMPLATE_BIN
from kvasird.config import load, render
from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LocalNode, die_with_parent
from kvasird.model.bundled import bundled_path
from tests.support import eventually

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(ANALYZE) is None,
                       reason=f"{ANALYZE} is not installed: the unit's syscall groups are unknown"),
    pytest.mark.skipif(ctypes.util.find_library("seccomp") is None,
                       reason="libseccomp is not installed: the unit's filters cannot be loaded"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="seccomp is Linux only"),
]

UNIT = Path(os.environ.get("KVASIRD_UNIT")
            or Path(__file__).resolve().parents[2] / "systemd" / "kvasird.service")
WATCHDOG_USEC = 1_000_000
READY_S = 90.0
SIGSYS_STATUS = -signal.SIGSYS
SERVING = {"gateway.local": True, "compute.threads": 1, "market.enroll_delay_s": 0.0,
           "market.memory_budget_mb": 200, "market.target_replicas": 1}
"""With [market] model the bundled one: the whole model served here, on one thread."""


def first_sent(notify: NotifySocket, key: str, alive: Callable[[], bool]) -> tuple[float, str]:
    """The first ``KEY=value`` the daemon sent; fails once it is not ``alive``."""
    return eventually(f"the daemon sends {key}=", lambda: notify.assignments(key),
                      timeout=READY_S, every=0.05, alive=alive,
                      context=lambda: f"on {notify.path}: {notify.messages}")[0]


@dataclass
class Service:
    """One node's home, run by the unit's Exec lines in the unit's sandbox."""

    net: LocalNet
    """Chooses the node's free loopback ports and writes them into its config."""
    unit_file: Path
    """The unit as run here (this kvasird, the state directory moved to the node's home)."""
    notify: NotifySocket
    """$NOTIFY_SOCKET: what the daemon tells systemd."""

    @property
    def node(self) -> LocalNode:
        return self.net.nodes[0]

    @property
    def unit(self) -> Unit:
        return Unit.read(self.unit_file.read_text())

    def environment(self) -> dict[str, str]:
        """What systemd gives the service: PATH, HOME (the user's, the state directory),
        Environment=, $NOTIFY_SOCKET and $WATCHDOG_USEC; nothing of this test's own."""
        return {"PATH": os.environ["PATH"], "HOME": str(self.node.home.root),
                **self.unit.environment(),
                "NOTIFY_SOCKET": str(self.notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}

    def start_pre(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(launcher(self.unit_file, self.unit.command("ExecStartPre")),
                              env=self.environment(), capture_output=True, text=True,
                              timeout=120)

    def start(self) -> None:
        """ExecStart=, its output in the node's log, as LocalNode.spawn would."""
        out = open(self.node.log, "ab")  # noqa: SIM115 - handed to the child process
        self.node.proc = subprocess.Popen(
            launcher(self.unit_file, self.unit.command("ExecStart")), env=self.environment(),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent)
        out.close()


@pytest.fixture
def service(localnet: Callable[..., LocalNet], tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """Make a Service from a unit's text (the repository's by default) and node settings."""
    made: list[NotifySocket] = []
    short = Path(tempfile.mkdtemp(prefix="kvasird-notify-"))  # AF_UNIX paths: 107 bytes at most

    def make(text: str | None = None, **settings: object) -> Service:
        net = localnet(1, settings=settings)
        home = net.nodes[0].home.root
        home.parent.mkdir(parents=True, exist_ok=True)
        text = UNIT.read_text() if text is None else text
        state = "/var/lib/" + Unit.read(text).last("StateDirectory")
        unit_file = tmp_path / f"kvasird{len(made)}.service"
        unit_file.write_text(text.replace(TEMPLATE_BIN, str(Path(sys.prefix) / "bin" / "kvasird"))
                             .replace(state, str(home)))
        made.append(NotifySocket(short / f"notify{len(made)}"))
        return Service(net, unit_file, made[-1])

    yield make
    for sock in made:
        sock.close()
    shutil.rmtree(short, ignore_errors=True)


def init_and_configure(svc: Service) -> None:
    """ExecStartPre= (kvasird init, in the sandbox), then free ports in its config: loopback
    ones, but for p2p TCP on every interface as in the default config, so that the daemon
    lists the interfaces to announce its addresses (nothing dials them)."""
    done = svc.start_pre()
    assert done.returncode == 0, (
        f"ExecStartPre exited with {done.returncode}"
        f"{' (SIGSYS: a system call the filter kills)' if done.returncode == SIGSYS_STATUS else ''}"
        f":\n{done.stdout}{done.stderr}")
    svc.net.configure(svc.node, [])
    home = svc.node.home
    listen = [a.replace("/ip4/127.0.0.1/", "/ip4/0.0.0.0/") if "/ws" not in a else a
              for a in load(home.config).p2p.listen]
    home.config.write_text(render(home.config.read_text(), {"p2p.listen": listen}))


def test_the_daemon_starts_serves_and_stops_under_the_units_sandbox(
        service: Callable[..., Service]) -> None:
    svc = service(**SERVING, **{"market.model": str(bundled_path())})
    init_and_configure(svc)
    svc.start()
    node = svc.node
    node.wait_ready(READY_S)
    assert node.proc is not None
    proc_status = Path(f"/proc/{node.proc.pid}/status").read_text()
    assert "NoNewPrivs:\t1" in proc_status and "Seccomp:\t2" in proc_status  # filters in force

    ready_at, _ = first_sent(svc.notify, "READY", node.alive)
    gateway = node.status()["gateway"]
    assert httpx.get(f"{gateway}/health").status_code == 200  # READY=1 meant it can serve
    statuses = svc.notify.assignments("STATUS")
    assert statuses[0][1].startswith("waiting (starting): "), svc.notify.messages
    assert [s for at, s in statuses if at == ready_at][0].startswith(f"gateway {gateway}: ")

    model = httpx.get(f"{gateway}/v1/models").json()["data"][0]["id"]
    answer = httpx.post(f"{gateway}/v1/completions", timeout=60, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1

    def fed() -> bool:
        pings = svc.notify.assignments("WATCHDOG")
        return len(pings) >= 3 and pings[-1][0] > ready_at

    # a ping after READY too: the answer above can come back within one ping period of it
    eventually("the watchdog is fed at half the period, after READY too", fed,
               timeout=5 * WATCHDOG_USEC / 1e6)

    assert node.stop() == 0, node.tail()
    assert [value for _, value in svc.notify.assignments("STOPPING")] == ["1"]
    assert not node.home.admin_file.exists()


def test_a_node_with_no_model_to_serve_is_ready_once_started(
        service: Callable[..., Service]) -> None:
    svc = service()
    init_and_configure(svc)
    svc.start()
    ready_at, _ = first_sent(svc.notify, "READY", svc.node.alive)
    assert svc.notify.assignments("STATUS")[0] == (
        ready_at, f"running without a gateway model, peer id {svc.node.status()['peer_id']}")
    assert svc.node.stop() == 0, svc.node.tail()


def test_without_the_units_allowances_the_sandbox_kills_the_daemon(
        service: Callable[..., Service]) -> None:
    """The sandbox has teeth: the unit less SystemCallErrorNumber= (numpy's OpenBLAS asks for
    mbind, outside the filter) dies of SIGSYS in `kvasird init`; less AF_NETLINK, `kvasird
    run` cannot list the network interfaces and exits."""
    text = UNIT.read_text()
    assert "\nSystemCallErrorNumber=" in text and " AF_NETLINK" in text
    killing = "\n".join(line for line in text.splitlines()
                        if not line.startswith("SystemCallErrorNumber="))
    assert service(killing).start_pre().returncode == SIGSYS_STATUS

    svc = service(text.replace(" AF_NETLINK", ""))
    init_and_configure(svc)
    svc.start()
    assert svc.node.proc is not None
    assert svc.node.proc.wait(READY_S) != 0
    assert "Address family not supported" in svc.node.tail(200)

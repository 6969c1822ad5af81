"""What a real `kvasird run` writes: with JSON logs (stderr not a terminal) every stderr line
is one JSON object and stdout holds nothing else, each API request is one access event
without secrets, and a taken port is one line naming the key to change."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kvasird.config import render
from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import die_with_parent
from kvasird.model.bundled import bundled_path
from tests.support import eventually, eventually_async

pytestmark = pytest.mark.slow

READY_S = 90.0
SECRET_KEY = "sk-never-logged-7f3a"
SECRET_QUERY = "never-logged-query-91c2"
PROMPT = "Name a colour that rhymes with bread."
PATH_HINT = "/srv/kvasird/kvasird.toml"


@dataclass
class Daemon:
    """A `kvasird run` process with stdout and stderr in files of their own."""

    proc: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    @classmethod
    def spawn(cls, home: Path, logs: Path) -> Daemon:
        out, err = logs / "stdout", logs / "stderr"
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = subprocess.Popen([sys.executable, "-m", "kvasird", "--home", str(home), "run"],
                                    stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                    preexec_fn=die_with_parent)
        return cls(proc, out, err)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def stderr_lines(self) -> list[str]:
        return self.stderr.read_text().splitlines()


def wait_for(what: str, predicate: Any, daemon: Daemon, timeout: float = READY_S) -> Any:
    """The first truthy value of ``predicate`` while the daemon runs; a failure carries the
    end of its stderr."""
    return eventually(what, predicate, timeout=timeout, alive=lambda: daemon.proc.poll() is None,
                      context=lambda: daemon.stderr.read_text()[-3000:])


def get_or_none(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


@dataclass(frozen=True)
class Served:
    """The output of a daemon that served requests, then stopped."""

    exit_status: int
    stdout: str
    stderr: list[str]
    health_polls: int
    """GET /health requests sent (one access event each is expected)."""
    gateway: str
    admin: str


@pytest.fixture(scope="module")
def served(module_tmp: Callable[[str], Path]) -> Iterator[Served]:
    """One daemon serving the bundled model: wait for health, serve a chat completion with an
    API key and a query string, ask the admin API, stop it."""
    root = module_tmp("logs")
    settings = {"market.model": str(bundled_path()), "market.memory_budget_mb": 200,
                "market.target_replicas": 1, "market.heartbeat_s": 1.0,
                "market.enroll_delay_s": 0.0, "compute.threads": 1, "gateway.local": True}
    net = LocalNet(root / "net", 1, settings=settings)
    node = net.nodes[0]
    net.configure(node, [])
    daemon = Daemon.spawn(node.home.root, root)
    try:
        admin = wait_for("the admin API answers", node.home.admin_address, daemon)
        status = wait_for("status answers", lambda: get_or_none(admin + "/v0/status"), daemon)
        gateway = status.json()["gateway"]
        polls = 0

        def healthy() -> bool | None:
            nonlocal polls
            polls += 1
            answer = get_or_none(gateway + "/health")
            return True if answer is not None and answer.status_code == 200 else None

        wait_for("the gateway is healthy", healthy, daemon)
        model = httpx.get(gateway + "/v1/models").json()["data"][0]["id"]
        reply = httpx.post(gateway + f"/v1/chat/completions?api_key={SECRET_QUERY}",
                           headers={"Authorization": f"Bearer {SECRET_KEY}"},
                           json={"model": model, "max_tokens": 3,
                                 "messages": [{"role": "user", "content": PROMPT}]}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert httpx.get(admin + f"/v0/status?token={SECRET_QUERY}").status_code == 200
        assert httpx.get(admin + "/v0/no-such-thing").status_code == 404
        exit_status = daemon.stop()
        yield Served(exit_status, daemon.stdout.read_text(), daemon.stderr_lines(), polls,
                     gateway, admin)
    finally:
        daemon.stop()
        net.down()


def events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines]


def test_every_stderr_line_is_one_json_object_and_stdout_is_empty(served: Served) -> None:
    assert served.exit_status == 0
    assert served.stdout == ""
    assert len(served.stderr) > 5
    for line in served.stderr:
        try:
            event = json.loads(line)
        except ValueError:
            pytest.fail(f"stderr line is not JSON: {line!r}")
        assert isinstance(event, dict) and "event" in event and "level" in event, line


def test_the_banner_is_one_json_event_on_stderr(served: Served) -> None:
    """As logs.banner logs it, or as a print to stdout becomes one event."""
    banners = [e for e in events(served.stderr) if e["event"] == "banner"
               or "join this node from another one with:" in str(e["event"])]
    assert len(banners) == 1
    assert any(e["event"] == "ready" for e in events(served.stderr))


def test_each_api_request_is_one_access_event(served: Served) -> None:
    requests = [e for e in events(served.stderr) if e["event"] == "request"]
    health = [e for e in requests if e["path"] == "/health"]
    assert len(health) == served.health_polls
    chat = [e for e in requests if e["path"] == "/v1/chat/completions"]
    assert len(chat) == 1
    assert chat[0]["api"] == "gateway" and chat[0]["method"] == "POST"
    assert chat[0]["status"] == 200 and chat[0]["ms"] > 0
    admin = {(e["path"], e["status"]) for e in requests if e["api"] == "admin API"}
    assert {("/v0/status", 200), ("/v0/no-such-thing", 404)} <= admin


def test_no_secret_query_or_prompt_reaches_the_log(served: Served) -> None:
    everything = "\n".join(served.stderr) + served.stdout
    for secret in (SECRET_KEY, SECRET_QUERY, PROMPT, "Bearer", "api_key", "token="):
        assert secret not in everything


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refusal(daemon: Daemon) -> list[str]:
    """The stderr lines of a daemon expected to refuse to start; every one but the last
    (the error) is a JSON log event."""
    try:
        status = daemon.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the daemon did not refuse to start: {daemon.stderr.read_text()[-2000:]}")
    lines = daemon.stderr_lines()
    assert status == 1 and lines, lines
    assert "Traceback" not in daemon.stderr.read_text()
    events(lines[:-1])
    assert daemon.stdout.read_text() == ""
    return lines


def test_a_second_daemon_on_the_same_p2p_port_refuses_to_start(tmp_path: Path) -> None:
    """py-libp2p's listener allowed sharing a port: the second daemon listened beside the
    first, and the kernel split incoming handshakes between the two."""
    net = LocalNet(tmp_path / "net", 2, settings={"gateway.enabled": False})
    first, second = net.nodes
    net.configure(first, [])
    net.configure(second, [])
    port = free_port()
    for node in (first, second):
        node.home.config.write_text(render(node.home.config.read_text(),
                                           {"p2p.listen": [f"/ip4/127.0.0.1/tcp/{port}"]}))
    try:
        first.start()
        daemon = Daemon.spawn(second.home.root, tmp_path)
        try:
            lines = refusal(daemon)
        finally:
            daemon.stop()
        assert lines[-1] == (f"kvasird: port {port} on 127.0.0.1 is in use (by another kvasird "
                             f"or another program): set [p2p] listen in {second.home.config} "
                             "to a free port")
        assert first.alive()
    finally:
        net.down()


@pytest.mark.parametrize("section", ["admin", "gateway"])
def test_a_taken_http_port_is_one_line_naming_its_key(tmp_path: Path, section: str) -> None:
    net = LocalNet(tmp_path / "net", 1)
    node = net.nodes[0]
    net.configure(node, [])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node.home.config.write_text(render(node.home.config.read_text(),
                                           {f"{section}.listen": f"127.0.0.1:{port}"}))
        daemon = Daemon.spawn(node.home.root, tmp_path)
        try:
            lines = refusal(daemon)
        finally:
            daemon.stop()
    assert lines[-1] == (f"kvasird: port {port} on 127.0.0.1 is in use (by another kvasird or "
                         f"another program): set [{section}] listen in {node.home.config} to a "
                         "free port")


FOREIGN = """
import logging, sys, warnings
import kvasird.p2p.host  # py-libp2p sets up its loggers on import, as in the daemon
from kvasird import logs
logs.configure("info")
logging.getLogger("libp2p.network.swarm").error("fail to open stream to peer %s", "QmPeer")
logging.getLogger("gguf.gguf_writer").info("Writing the following files:")
logging.getLogger("hypercorn.error").warning("hypercorn says %d", 1)
print("a dependency prints", "this")
print("without a newline", end="")
sys.stdout.flush()
warnings.warn("something is off", stacklevel=1)
logs.get_logger("kvasird.test").info("ours", n=1)
logs.banner("kvasird 0.0.0\\npeer id      12D3KooWX\\nready", peer_id="12D3KooWX")
"""


def test_dependencies_logs_prints_and_warnings_become_json_events() -> None:
    done = subprocess.run([sys.executable, "-c", FOREIGN], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    logged = {(e.get("logger"), e["level"], e["event"]) for e in events(done.stderr.splitlines())}
    assert {("libp2p.network.swarm", "error", "fail to open stream to peer QmPeer"),
            ("gguf.gguf_writer", "info", "Writing the following files:"),
            ("hypercorn.error", "warning", "hypercorn says 1"),
            ("stdout", "info", "a dependency prints this"),
            ("stdout", "info", "without a newline"),
            ("kvasird.test", "info", "ours"),
            ("kvasird.daemon", "info", "banner")} <= logged
    assert not any("peer id      12D3KooWX" in event for _, _, event in logged)
    assert any(logger == "py.warnings" and "something is off" in event
               for logger, _, event in logged)


async def test_the_access_event_has_what_the_app_noted_and_no_secret() -> None:
    """What an app notes (the gateway's token counts) joins its request's event; a failing
    app's request is logged with status 500."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from structlog.testing import capture_logs

    from kvasird.http import note_access, serve_asgi

    async def generate(request: Request) -> JSONResponse:
        note_access(request.scope, prompt_tokens=7, completion_tokens=3)
        return JSONResponse({"ok": True})

    async def broken(request: Request) -> JSONResponse:
        raise RuntimeError("the app failed")

    app = Starlette(routes=[Route("/v1/generate", generate, methods=["POST"]),
                            Route("/broken", broken)])
    async with trio.open_nursery() as nursery:
        url = await nursery.start(lambda task_status: serve_asgi(
            app, "127.0.0.1:0", what="gateway", section="gateway", config_path=PATH_HINT,
            allowed_hosts=(), task_status=task_status))
        with capture_logs() as logged:
            async with httpx.AsyncClient() as client:
                answer = await client.post(f"{url}/v1/generate?key={SECRET_QUERY}",
                                           headers={"Authorization": f"Bearer {SECRET_KEY}"},
                                           content=PROMPT)
                assert answer.status_code == 200
                assert (await client.get(f"{url}/broken")).status_code == 500
            # the 500 reaches the client before the error leaves
            await eventually_async("both requests are logged", lambda: len(
                [e for e in logged if e["event"] == "request"]) >= 2, timeout=10, every=0.01)
        nursery.cancel_scope.cancel()
    requests = [e for e in logged if e["event"] == "request"]
    assert requests[0] == {"event": "request", "log_level": "info", "api": "gateway",
                           "method": "POST", "path": "/v1/generate", "status": 200,
                           "ms": requests[0]["ms"], "prompt_tokens": 7, "completion_tokens": 3}
    assert (requests[1]["path"], requests[1]["status"]) == ("/broken", 500)
    assert len(requests) == 2
    for secret in (SECRET_KEY, SECRET_QUERY, PROMPT):
        assert secret not in repr(logged)


def test_on_a_terminal_the_banner_and_prints_stay_text() -> None:
    script = ('from kvasird import logs\nlogs.configure("info")\nprint("printed")\n'
              'logs.banner("kvasird 0.0.0\\nready", peer_id="12D3KooWX")\n')
    leader, follower = os.openpty()
    try:
        try:
            done = subprocess.run([sys.executable, "-c", script], stdout=follower,
                                  stderr=subprocess.PIPE, text=True, timeout=60)
        finally:
            os.close(follower)
        shown = b""
        while chunk := _read_or_nothing(leader):
            shown += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0 and done.stderr == ""
    assert shown.decode().splitlines() == ["printed", "kvasird 0.0.0", "ready"]


def _read_or_nothing(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: the terminal's other end is closed and everything was read
        return b""

"""Headless Chromium against a page: a screenshot, the DOM once its scripts have run, or
the value of an expression evaluated in it (the DevTools protocol, over a pipe).

Imported by name (the gateway tests' conftest puts this folder on sys.path; so does
bench/dashboard_screenshots.py). Each call gets a fresh profile in a temporary folder,
removed afterwards, and never reaches past loopback (no sync, no updates, no QUIC).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")
TIMEOUT_S = 120


@contextlib.contextmanager
def _chromium(*args: str, **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """Chromium with a profile of its own, in its own process group: killed whole on the
    way out (helpers can outlive the browser's process, still writing to the profile), and
    the profile removed once nothing writes to it."""
    assert CHROMIUM is not None, "chromium is not installed"
    profile = tempfile.mkdtemp(prefix="kvasird-chromium-")
    try:
        proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                                start_new_session=True, text=True, **popen)
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        _remove(profile)


def _run(url: str, width: int, height: int, *extra: str) -> str:
    with _chromium(f"--window-size={width},{height}", "--virtual-time-budget=3000", *extra,
                   url, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"chromium failed on {url}:\n{err[-2000:]}"
    return out


def screenshot(url: str, out: Path, width: int = 1280, height: int = 900) -> Path:
    _run(url, width, height, f"--screenshot={out}")
    assert out.is_file(), f"chromium wrote no screenshot of {url}"
    return out


def dom(url: str, width: int = 1280, height: int = 900) -> str:
    """The page's DOM, serialized after its scripts ran for 3 s of virtual time."""
    return _run(url, width, height, "--dump-dom")


def ask(question: str, temperature: float = 0.0) -> str:
    """An expression that asks the dashboard's chat ``question`` and, once answered, is the
    chat's log as [[class, text], ...]."""
    return f"""(async () => {{
  const form = document.getElementById('chat');
  form.q.value = {json.dumps(question)};
  form.temperature.value = {json.dumps(temperature)};
  form.requestSubmit();
  do await new Promise(r => setTimeout(r, 100)); while (form.send.disabled);
  return [...document.querySelectorAll('#chat-log p')].map(p => [p.className, p.textContent]);
}})()"""


def evaluate(url: str, expression: str, width: int = 1280, height: int = 900,
             shot: Path | None = None) -> Any:
    """The value of ``expression`` (a promise is awaited) in the page at ``url``, once it has
    loaded, and a screenshot to ``shot`` right after: the DevTools protocol over a pipe (fds
    3 and 4 of the browser), so nothing listens on a port."""
    assert CHROMIUM is not None, "chromium is not installed"
    to_browser, from_browser = os.pipe(), os.pipe()

    def pipes_on_3_and_4() -> None:
        high = os.dup(to_browser[0]), os.dup(from_browser[1])
        os.dup2(high[0], 3)
        os.dup2(high[1], 4)

    with _chromium(f"--window-size={width},{height}", "--remote-debugging-pipe", "about:blank",
                   pass_fds=(3, 4), preexec_fn=pipes_on_3_and_4,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
        os.close(to_browser[0])
        os.close(from_browser[1])
        devtools = _DevTools(to_browser[1], from_browser[0])
        try:
            pages = [t for t in devtools.call("Target.getTargets")["targetInfos"]
                     if t["type"] == "page"]
            session = devtools.call("Target.attachToTarget", targetId=pages[0]["targetId"],
                                    flatten=True)["sessionId"]
            devtools.call("Page.navigate", session, url=url)
            loaded = "new Promise(r => document.readyState === 'complete' ? r() : " \
                     "addEventListener('load', () => r()))"
            for source in (loaded, expression):
                out = devtools.call("Runtime.evaluate", session, expression=source,
                                    awaitPromise=True, returnByValue=True)
                assert "exceptionDetails" not in out, out["exceptionDetails"]
            if shot is not None:  # the whole page, as tall as its content
                size = devtools.call("Page.getLayoutMetrics", session)["cssContentSize"]
                png = devtools.call("Page.captureScreenshot", session, format="png",
                                    captureBeyondViewport=True, clip={
                                        "x": 0, "y": 0, "width": width, "scale": 1,
                                        "height": max(size["height"], height)})["data"]
                shot.write_bytes(base64.b64decode(png))
            return out["result"].get("value")
        finally:
            os.close(to_browser[1])
            os.close(from_browser[0])


def _remove(profile: str) -> None:
    """Remove the profile folder once nothing writes to it any more (a killed helper's
    last writes may still land while the first removal runs)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            shutil.rmtree(profile)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class _DevTools:
    """Requests and their answers over the browser's pipe (JSON messages ended by NUL)."""

    def __init__(self, write_fd: int, read_fd: int) -> None:
        self._out, self._in = os.fdopen(write_fd, "wb", closefd=False), read_fd
        self._buffer = b""
        self._id = 0

    def call(self, method: str, session: str | None = None, **params: Any) -> Any:
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        self._out.write(json.dumps(message).encode() + b"\0")
        self._out.flush()
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            while b"\0" not in self._buffer:
                assert time.monotonic() < deadline, f"no answer to {method}"
                ready, _, _ = select.select([self._in], [], [], 1.0)
                if ready:
                    chunk = os.read(self._in, 1 << 16)
                    assert chunk, "the browser closed its DevTools pipe"
                    self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._id:
                assert "error" not in answer, f"{method}: {answer['error']}"
                return answer["result"]

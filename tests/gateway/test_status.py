"""/health, /status, the status page (rendered in headless Chromium) and `kvasird chat`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from gateway_daemon import Daemon  # type: ignore[import-not-found]
from greedy import greedy  # type: ignore[import-not-found]
from PIL import Image

from kvasird.gateway.status import COLOURS
from kvasird.inference.chat import Message
from kvasird.localnet.demo import SYSTEM

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--hide-scrollbars", "--window-size=800,900"]


def covered(daemon: Daemon) -> dict[str, object]:
    """The status once the node has enrolled in every unit of the model."""
    deadline = time.monotonic() + 30
    while True:
        status = httpx.get(daemon.url + "/status").json()
        if status["coverage"]["fully_covered"]:
            return status  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, "the node never covered its model"
        time.sleep(0.2)


def test_health_says_ok_and_nothing_else(daemon: Daemon) -> None:
    r = httpx.get(daemon.url + "/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_status_reports_node_coverage_and_served_requests(daemon: Daemon) -> None:
    httpx.post(daemon.url + "/v1/chat/completions", timeout=30, json={
        "model": daemon.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    status = covered(daemon)
    assert status["ready"] is True
    assert status["node"]["peer_id"] == daemon.node.peer_id  # type: ignore[index]
    assert "pid" not in status["node"]  # type: ignore[operator]
    gw = status["gateway"]
    assert gw["requests_served"] >= 1 and gw["tokens_generated"] >= 1  # type: ignore[index]
    assert gw["decode_tokens_per_s"] > 0  # type: ignore[index]
    segments = status["coverage"]["segments"]  # type: ignore[index]
    assert {"unit": "layers", "layers": [0, 30], "replicas": 1, "target": 1,
            "scarcity": 0.0} in segments
    assert status["models"] == [{"id": daemon.model, "label": "Smollm2 135M 8k Lc100K Mix1 Ep2",
                                 "context_length": 8192}]


def test_status_page_is_self_contained_html(daemon: Daemon) -> None:
    covered(daemon)
    r = httpx.get(daemon.url + "/")
    assert r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<svg" in page and daemon.node.peer_id in page and "layers 0-29: 1/1 replicas" in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "<script" not in page


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(apt-get install -y chromium)")
def test_status_page_renders_the_coverage_picture_in_chromium(daemon: Daemon,
                                                              tmp_path: Path) -> None:
    covered(daemon)
    shot = tmp_path / "status.png"
    subprocess.run([str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                    f"--screenshot={shot}", daemon.url + "/"],
                   check=True, capture_output=True, timeout=120)
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    green = [int(COLOURS["full"][i:i + 2], 16) for i in (1, 3, 5)]
    share = float((pixels == green).all(axis=1).mean())
    assert share > 0.01, f"the coverage picture ({COLOURS['full']}) is not on the screenshot"


def test_kvasird_chat_streams_an_answer(daemon: Daemon) -> None:
    question = "What is the capital of France?"
    done = subprocess.run(
        [sys.executable, "-m", "kvasird", "chat", "--url", daemon.url, "--temperature", "0",
         "--max-tokens", "16", "--system", SYSTEM, question],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answer = greedy([Message("system", SYSTEM), Message("user", question)], 16)
    assert done.stdout.strip() == answer.text.strip()


def test_kvasird_chat_names_a_refusal(daemon: Daemon) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvasird", "chat", "--url", daemon.url, "--model", "nope", "x"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "404" in done.stderr and "not served" in done.stderr

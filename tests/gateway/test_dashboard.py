"""The dashboard in headless Chromium, on a real two-node swarm, then with a node down.

Node 0 (the gateway) holds the head and layers 0-14 of the bundled model, node 1 layers
15-29: a request runs along a route through both. Stopping node 1 takes the route away,
and both /health and the page have to say so.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from browser import CHROMIUM, ask, dom, evaluate, screenshot  # type: ignore[import-not-found]
from PIL import Image

from kvasird.gateway.dashboard import COLOURS
from kvasird.localnet import LocalNet
from kvasird.localnet.placement import pinned
from kvasird.model.bundled import bundled_path
from tests.support import eventually

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (apt-get install -y chromium)")]

N_LAYER = 30
PLACEMENT = [["head", "layers:0-15"], ["layers:15-30"]]
READY_S = 120.0


@pytest.fixture(scope="module")
def swarm(module_tmp: Callable[[str], Path]) -> Iterator[tuple[LocalNet, str]]:
    net = LocalNet(module_tmp("dashboard"), len(PLACEMENT))
    try:
        previous = ""
        for node, pins in zip(net.nodes, PLACEMENT, strict=True):
            net.settings = {**net.settings, **pinned(bundled_path(), pins)}
            previous = net.configure(node, [previous] if previous else [])
        for node in net.nodes:
            node.spawn()
        for node in net.nodes:
            node.wait_ready()
        url = net.nodes[0].status()["gateway"]
        eventually("the gateway routes through both nodes",
                   lambda: httpx.get(url + "/health").status_code == 200, timeout=READY_S,
                   every=0.2)
        yield net, url
    finally:
        net.down()


def coverage_cells(page: str) -> dict[int, str]:
    """Column -> tooltip of each cell of the topology's coverage row (0 is the head)."""
    cells = re.findall(r'<rect class="cov" data-col="(\d+)"[^>]*><title>([^<]*)</title>', page)
    return {int(col): tip for col, tip in cells}


def test_dashboard_shows_every_part_once_scripts_ran(swarm: tuple[LocalNet, str]) -> None:
    net, url = swarm
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": httpx.get(url + "/v1/models").json()["data"][0]["id"],
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    for width in (1280, 390):
        page = dom(url + "/", width)
        assert re.search(r'id="state" data-state="ok"[^>]*>ready<', page)
        cells = coverage_cells(page)
        assert sorted(cells) == list(range(N_LAYER + 1)), "one cell per layer and the head"
        me, other = (_short(n.peer_id) for n in net.nodes)
        assert cells[0] == f"head: 1/1 replicas · held by {me}"
        for layer in range(N_LAYER):
            holder = me if layer < 15 else other
            assert cells[layer + 1] == f"layer {layer}: 1/1 replicas · held by {holder}"
        assert f"<title>{other}: layer 15 (online)</title>" in page
        assert "hop 2: " + other + " · layers 15-29" in page
        peers = page[page.index('<table class="peers">'):]
        assert net.nodes[1].peer_id in peers and "layers 15-29" in peers
        assert re.search(r"<td>\d+(\.\d)? ms</td>", peers), "the peer's RTT is shown"
        assert not re.search(r"\d\.\d\d+ ms", page), "times are rounded (36 ms, 0.4 ms)"
        assert re.search(r'<svg id="chart-tps"[^>]*><polyline points="[\d., ]+"', page), \
            "the script drew the tokens/s chart"
        assert re.search(r'id="chart-tps-now">\d+(\.\d)? tokens/s<', page)
        assert re.search(r'id="chart-ttft-now">\d+(\.\d)? ms<', page)
        assert 'id="earnings"' in page and "Settlement is off" in page
        assert re.search(r'<form id="chat" data-model="[0-9a-f]{64}">', page)
        assert 'id="shards"' in page and "held" in page


@pytest.mark.parametrize("width", [1280, 390])
def test_dashboard_screenshot_is_a_real_picture(swarm: tuple[LocalNet, str], width: int,
                                                tmp_path: Path) -> None:
    _, url = swarm
    shot = screenshot(url + "/", tmp_path / "dashboard.png", width, 900)
    image = np.asarray(Image.open(shot).convert("RGB"))
    assert image.shape[1] == width
    pixels = image.reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 50, "the screenshot is (nearly) blank"
    green = [int(COLOURS["full"][i:i + 2], 16) for i in (1, 3, 5)]
    assert (pixels == green).all(axis=1).mean() > 0.001, "the coverage row is not on it"
    if width == 390:  # the phone layout: cards end a margin before the right edge
        right = image[:, width - 8]
        background = (right == [0xf4, 0xf6, 0xf8]).all(axis=1).mean()
        assert background > 0.9, "the page is wider than a phone's screen"


def test_the_web_chat_answers_through_this_gateway(swarm: tuple[LocalNet, str]) -> None:
    _, url = swarm
    served = httpx.get(url + "/status").json()["gateway"]["requests_served"]
    log = evaluate(url + "/", ask("What is the capital of France?"))
    assert [cls for cls, _ in log] == ["user", "assistant"], log
    assert log[0][1] == "What is the capital of France?" and log[1][1].strip(), log
    assert httpx.get(url + "/status").json()["gateway"]["requests_served"] == served + 1


def test_a_node_down_takes_the_route_and_health_says_which_layers(
        swarm: tuple[LocalNet, str]) -> None:
    net, url = swarm
    net.nodes[1].stop()
    eventually("the gateway notices", lambda: httpx.get(url + "/health").status_code == 503,
               timeout=60, every=0.2)
    body = httpx.get(url + "/health").json()
    assert body["status"] == "no_route" and "layers 15-29" in body["reason"], body
    page = dom(url + "/")
    assert re.search(r'id="state" data-state="no_route"[^>]*>no route<', page)
    assert "no route: nobody fit serves layers 15-29" in page
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 503


def _short(peer: str) -> str:
    return f"{peer[:4]}…{peer[-6:]}"

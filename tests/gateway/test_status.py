"""/health and readiness (each state, over real HTTP), /status, the page and `kvasird chat`."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
from gateway_daemon import Daemon  # type: ignore[import-not-found]
from greedy import greedy  # type: ignore[import-not-found]

from kvasird.config import GatewayConfig
from kvasird.config.schema import InferenceConfig
from kvasird.gateway import dashboard, status
from kvasird.gateway.service import Gateway
from kvasird.inference.api import ModelInfo
from kvasird.inference.client.routing import Fitness, Latency, PeerHoldings
from kvasird.inference.client.swarm import Inbox, SwarmGenerator
from kvasird.localnet.demo import SYSTEM
from kvasird.market.records import Holding
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest
from kvasird.text.chat import Message
from tests.support import eventually

N_LAYER = 30


def swarm(holders: Callable[[], list[PeerHoldings]]) -> SwarmGenerator:
    """A gateway's swarm generator over a coverage map of `holders` (planning only: nothing
    here sends a step)."""
    nothing: Any = None
    return SwarmGenerator("me", lambda: ModelInfo("m" * 64, "Smollm2", 8192), lambda: N_LAYER,
                          holders, nothing, nothing, Latency("me", lambda p: None),
                          Fitness(60), InferenceConfig(), Inbox())


HEAD_AND_FIRST = PeerHoldings("a", True, ((0, 10),), ())
MIDDLE = PeerHoldings("b", False, ((10, 20),), ())
LAST = PeerHoldings("c", False, ((20, 30),), ())


async def get_health(gw: Gateway) -> tuple[int, dict[str, str]]:
    async with httpx.AsyncClient() as http:
        r = await http.get(gw.url + "/health")
    return r.status_code, r.json()


async def test_a_gateway_without_a_model_says_no_model_not_starting() -> None:
    gw = Gateway(GatewayConfig(listen="127.0.0.1:0"))
    async with trio.open_nursery() as nursery:
        await nursery.start(gw.run)
        code, body = await get_health(gw)
        nursery.cancel_scope.cancel()
    assert (code, body["status"]) == (503, "no_model")
    assert "[market] model" in body["reason"]
    assert gw.ready is False


async def test_a_gateway_waiting_for_its_model_says_starting() -> None:
    gw = Gateway(GatewayConfig(listen="127.0.0.1:0"), generator=swarm(lambda: []),
                 model=lambda: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(gw.run)
        code, body = await get_health(gw)
        nursery.cancel_scope.cancel()
    assert (code, body["status"]) == (503, "starting")
    assert "waiting for the model" in body["reason"]
    assert gw.ready is False


async def test_health_follows_the_route_through_the_coverage_map() -> None:
    """ok only while the online peers chain the model's layers; the gap is named."""
    coverage = [HEAD_AND_FIRST, LAST]
    gw = Gateway(GatewayConfig(listen="127.0.0.1:0"), generator=swarm(lambda: coverage),
                 model=lambda: Manifest.from_gguf(bundled_path()))
    async with trio.open_nursery() as nursery:
        await nursery.start(gw.run)
        with trio.fail_after(30):
            while (await get_health(gw))[1]["status"] == "starting":  # the tokenizer loads
                await trio.sleep(0.05)
        code, body = await get_health(gw)
        assert (code, body["status"]) == (503, "no_route")
        assert "layers 10-19" in body["reason"]
        assert gw.ready is False
        coverage.insert(1, MIDDLE)
        assert await get_health(gw) == (200, {"status": "ok", "reason": "serving Smollm2"})
        assert gw.ready is True
        coverage.remove(HEAD_AND_FIRST)
        code, body = await get_health(gw)
        assert (code, body["status"]) == (503, "no_route") and "head" in body["reason"]
        nursery.cancel_scope.cancel()


async def test_status_shows_the_route_a_request_would_take() -> None:
    gw = Gateway(GatewayConfig(listen="127.0.0.1:0"),
                 generator=swarm(lambda: [HEAD_AND_FIRST, MIDDLE, LAST]))
    snap = status.snapshot(gw)
    assert snap["ready"] is True and snap["health"]["status"] == "ok"
    hops = snap["gateway"]["route_now"]
    assert [(h["peer"], h["first"], h["end"]) for h in hops] == [
        ("a", 0, 10), ("b", 10, 20), ("c", 20, 30), ("a", 30, 30)]
    assert snap["gateway"]["missing"] is None


def covered(daemon: Daemon) -> dict[str, object]:
    """The status once the node has enrolled in every unit of the model."""
    def fully_covered() -> dict[str, object] | None:
        got = httpx.get(daemon.url + "/status").json()
        return got if got["coverage"]["fully_covered"] else None

    return eventually("the node covers its model", fully_covered, timeout=30, every=0.2)


@pytest.mark.slow
def test_health_of_a_serving_daemon_says_ok_and_nothing_else(daemon: Daemon) -> None:
    label = httpx.get(daemon.url + "/status").json()["models"][0]["label"]
    r = httpx.get(daemon.url + "/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "reason": f"serving {label}"})


@pytest.mark.slow
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
    assert status["models"] == [{"id": daemon.model, "label": status["models"][0]["label"],
                                 "context_length": 8192}]
    assert status["health"] == {"status": "ok", "reason": f"serving {status['models'][0]['label']}"}


@pytest.mark.slow
def test_status_page_is_self_contained_html(daemon: Daemon) -> None:
    covered(daemon)
    r = httpx.get(daemon.url + "/")
    assert r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<svg" in page and daemon.node.peer_id in page and "layer 29: 1/1 replicas" in page
    assert "<title>layers 0-29" not in page  # each layer's cell names its own layer
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page and " src=" not in page


@pytest.mark.slow
def test_kvasird_chat_streams_an_answer(daemon: Daemon) -> None:
    question = "What is the capital of France?"
    done = subprocess.run(
        [sys.executable, "-m", "kvasird", "chat", "--url", daemon.url, "--temperature", "0",
         "--max-tokens", "16", "--system", SYSTEM, question],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answer = greedy([Message("system", SYSTEM), Message("user", question)], 16)
    assert done.stdout.strip() == answer.text.strip()


@pytest.mark.slow
def test_kvasird_chat_names_a_refusal(daemon: Daemon) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvasird", "chat", "--url", daemon.url, "--model", "nope", "x"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "'nope'" in done.stderr


async def test_the_page_says_no_route_and_draws_expert_ranges_per_peer() -> None:
    """A MoE coverage map (two layers of 8 experts): each peer's expert ranges are drawn in
    its row, at their place in the layer's cell; the state says no route, with the gap."""
    gw = Gateway(GatewayConfig(listen="127.0.0.1:0"), generator=swarm(lambda: [LAST]))
    snap = status.snapshot(gw)
    a, b = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAaaaaaa", "12D3KooWBBBBBBBBBBbbbbbb"
    snap["node"] = {"peer_id": a, "network": "test", "uptime_s": 5.0, "version": "0"}
    snap["coverage"] = {
        "model": {"id": "m" * 64, "n_layer": 2, "n_expert": 8, "bytes": 2**20},
        "holders": {a: {"holdings": [Holding(*h).to_wire() for h in (
                        ("H", 0, 0, 1, "online"), ("L", 0, 0, 2, "online"),
                        ("E", 0, 0, 4, "online"), ("E", 1, 0, 4, "online"))]},
                    b: {"holdings": [Holding("E", 1, 4, 8, "loading").to_wire()]}},
        "segments": [{"unit": "head", "replicas": 1, "target": 1},
                     {"unit": "layers", "layers": [0, 2], "replicas": 1, "target": 1},
                     *({"unit": "experts", "layer": layer, "experts": experts, "replicas": r,
                        "target": 1} for layer, experts, r in ((0, [0, 4], 1), (0, [4, 8], 0),
                                                                (1, [0, 8], 1)))]}
    page = dashboard.page(snap)
    assert 'data-state="no_route"' in page and ">no route<" in page
    assert "No route now: nobody fit serves head, layers 0-19." in page
    tips = re.findall(r'<rect class="cov" data-col="(\d)"[^>]*><title>([^<]*)<', page)
    assert tips == [("0", "head: 1/1 replicas · held by 12D3…aaaaaa"),
                    ("1", "layer 0: 0/1 replicas · held by 12D3…aaaaaa"),
                    ("2", "layer 1: 1/1 replicas · held by 12D3…aaaaaa, 12D3…bbbbbb")]
    cell = re.search(r'<rect class="cell" data-col="2" x="[\d.]+" y="([\d.]+)" width="[\d.]+" '
                     r'height="([\d.]+)" fill="#c2487a66"><title>12D3…bbbbbb: layer 1 experts '
                     r'4-7 \(loading\)</title>', page)
    assert cell is not None, "b's experts 4-7 of layer 1, faded while loading"
    row_top = 2 * (dashboard.ROW + dashboard.GAP)  # b's row: after coverage and a's
    assert (float(cell[1]), float(cell[2])) == (row_top + dashboard.ROW / 2, dashboard.ROW / 2)

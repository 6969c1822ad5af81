"""Spot checks across real daemons on 127.0.0.1, with the default settings: a stage and an
expert worker that return perturbed outputs (faulty_daemon: lying-stage, lying-experts),
and a stage that lies only on the decode steps forwarded to it (lying-decode), on a route
of the gateway and that stage or of several peers, are caught within the sessions
docs/verification.md predicts, avoided afterwards, and the evidence is
kept on the checking node.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from faulty_daemon import command  # type: ignore[import-not-found]

from kvasird.config import InferenceConfig
from kvasird.inference.client.spotcheck import within
from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LocalNode
from kvasird.localnet.placement import pinned
from kvasird_dev.testmodels import make_model

pytestmark = pytest.mark.slow

DEFAULTS = InferenceConfig()
STAGE_SESSIONS = within(DEFAULTS.spot_check_stages, 0.9999) or 0
"""docs/verification.md: a lying stage is caught within this many of its sessions."""
WORKER_CALLS = within(DEFAULTS.spot_check, 0.9999) or 0
"""... and a lying worker within this many of its calls."""
ROUTED_S = 90.0
PROMPT = [1, 504, 3458, 282, 4649, 314]


def start(localnet: Callable[..., LocalNet], model: Path, placement: list[list[str]],
          faults: dict[int, str]) -> LocalNet:
    """A net whose node i holds placement[i] (node i runs faults[i], if any), every node
    with the default spot check settings, ready once the first node has a route."""
    net = localnet(len(placement))
    previous = ""
    for node, pins in zip(net.nodes, placement, strict=True):
        node.settings = pinned(model, pins)
        previous = net.configure(node, [previous] if previous else [])
    for node in net.nodes:
        if node.index in faults:
            node.command = command(faults[node.index])
        node.spawn()
    for node in net.nodes:
        node.wait_ready()
    net.wait_until("the gateway sees every node's holdings online and proven",
                   lambda: online(net.nodes[0], len(placement)), ROUTED_S)
    return net


def online(node: LocalNode, n: int) -> bool:
    """Every node's holdings online, and every other node's claim proven to `node` (a
    holder is routed to, and asked to check, only once proven): a check drawn before the
    third holder of a part is proven has one checker, and its disagreement is undecided."""
    holders = node.get("/v0/coverage").get("holders") or {}
    return len(holders) == n and all(
        h["holdings"]
        and all(x[-1] == "online" for x in h["holdings"])
        and (peer == node.peer_id or h["proven_units"])
        for peer, h in holders.items()
    )


def generate(node: LocalNode, prompt: list[int], n: int = 4) -> list[int]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    resp = httpx.post(node.home.admin_address() + "/v0/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    events = [json.loads(line) for line in resp.text.splitlines() if line]
    assert all("error" not in e for e in events), events
    return [e["token"] for e in events if "token" in e]


def spot(node: LocalNode) -> dict[str, Any]:
    return node.get("/v0/inference")["spot_checks"]


def caught_within(gateway: LocalNode, kind: str | tuple[str, ...], prompts: int) -> None:
    """Generate until the gateway's node has caught someone by a check of `kind` (or one of
    them; at most `prompts` times)."""
    kinds = (kind,) if isinstance(kind, str) else kind
    for i in range(prompts):
        generate(gateway, [*PROMPT, i])
        if any(spot(gateway)[k]["caught"] for k in kinds):
            return
    pytest.fail(f"nobody caught within {prompts} generations: {spot(gateway)}")


def kept(node: LocalNode) -> list[dict[str, Any]]:
    """The evidence file in `node`'s home."""
    path = node.home.root / "spotchecks" / "evidence.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_lying_stage_is_caught_within_the_predicted_sessions_and_avoided(
        localnet: Callable[..., LocalNet], tmp_path: Path) -> None:
    """The gateway holds the head and layer 0; three peers hold layers 1-3, node 1 lies.
    Which of them a route takes goes by latency: the bound is on the liar's sessions. A liar
    that lies to everyone is also caught when it is drawn to check another hop (its first
    chunk or a later step, contradicted by a second checker): then before any session of
    its own."""
    model = make_model(tmp_path / "dense.gguf", arch="llama", n_layer=4, n_embd=256, n_head=8,
                       n_head_kv=4, head_dim=32, n_ff=1024, dtype="f32")
    net = start(localnet, model, [["head", "layers:0-1"], ["layers:1-4"], ["layers:1-4"],
                                  ["layers:1-4"]], {1: "lying-stage"})
    gateway, liar = net.nodes[0], net.nodes[1]
    caught_within(gateway, ("stages", "decode"), 4 * STAGE_SESSIONS)
    view = spot(gateway)
    assert [e["peer"] for e in view["evidence"]] == [liar.peer_id]  # no honest peer flagged
    evidence = view["evidence"][0]
    assert evidence["kind"] in ("stage", "decode")
    assert evidence["sessions"] <= STAGE_SESSIONS
    assert evidence["divergence"] > DEFAULTS.spot_tolerance
    assert kept(gateway)[0]["input_sha256"] == evidence["input_sha256"]
    assert (gateway.home.root / "spotchecks" / evidence["arrays"]).exists()
    assert liar.peer_id in gateway.get("/v0/inference")["unfit"]
    forwarded = liar.get("/v0/inference")["serving"]["forwarded"]
    for i in range(5):
        generate(gateway, [*PROMPT, 100 + i], 8)
    assert liar.get("/v0/inference")["serving"]["forwarded"] == forwarded  # avoided
    assert view["stages"]["unresolved"] == 0


def test_a_stage_lying_only_on_decode_steps_is_caught_and_avoided(
        localnet: Callable[..., LocalNet], tmp_path: Path) -> None:
    """As above, node 1 computing the relayed first chunk honestly: the first-chunk checks
    pass it, the rows it must show of its drawn sessions' later steps catch it."""
    model = make_model(tmp_path / "dense.gguf", arch="llama", n_layer=4, n_embd=256, n_head=8,
                       n_head_kv=4, head_dim=32, n_ff=1024, dtype="f32")
    net = start(localnet, model, [["head", "layers:0-1"], ["layers:1-4"], ["layers:1-4"],
                                  ["layers:1-4"]], {1: "lying-decode"})
    gateway, liar = net.nodes[0], net.nodes[1]
    caught_within(gateway, "decode", 4 * STAGE_SESSIONS)
    view = spot(gateway)
    assert [e["peer"] for e in view["evidence"]] == [liar.peer_id]
    evidence = view["evidence"][0]
    assert evidence["kind"] == "decode" and evidence["unit"] == "layers 1-3 (decode steps)"
    assert evidence["sessions"] <= STAGE_SESSIONS
    assert view["stages"]["caught"] == 0 and view["decode"]["unresolved"] == 0
    assert kept(gateway)[0]["kind"] == "decode"
    assert liar.peer_id in gateway.get("/v0/inference")["unfit"]
    forwarded = liar.get("/v0/inference")["serving"]["forwarded"]
    for i in range(5):
        generate(gateway, [*PROMPT, 100 + i], 8)
    assert liar.get("/v0/inference")["serving"]["forwarded"] == forwarded  # avoided


def test_a_stage_lying_on_decode_steps_on_a_route_of_several_peers_is_caught(
        localnet: Callable[..., LocalNet], tmp_path: Path) -> None:
    """The route is the gateway (head, layer 0), one of nodes 1-3 (layers 1-2: node 1 lies
    on the decode steps forwarded to it) and node 4 (layer 3, nobody else's): no replay
    could tell which of node 1 and node 4 lied, but the rows node 1 must show of a drawn
    step, recomputed on the other two holders of its part, name it; node 4 is never
    flagged."""
    model = make_model(tmp_path / "dense.gguf", arch="llama", n_layer=4, n_embd=256, n_head=8,
                       n_head_kv=4, head_dim=32, n_ff=1024, dtype="f32")
    net = start(localnet, model, [["head", "layers:0-1"], ["layers:1-3"], ["layers:1-3"],
                                  ["layers:1-3"], ["layers:3-4"]], {1: "lying-decode"})
    gateway, liar, alone = net.nodes[0], net.nodes[1], net.nodes[4]
    caught_within(gateway, "decode", 4 * STAGE_SESSIONS)
    view = spot(gateway)
    assert [e["peer"] for e in view["evidence"]] == [liar.peer_id]
    evidence = view["evidence"][0]
    assert evidence["kind"] == "decode" and evidence["unit"] == "layers 1-2 (decode steps)"
    assert evidence["sessions"] <= STAGE_SESSIONS
    assert set(evidence["checkers"]) == {net.nodes[2].peer_id, net.nodes[3].peer_id}
    assert view["decode"]["unshown"] == 0
    unfit = gateway.get("/v0/inference")["unfit"]
    assert liar.peer_id in unfit and alone.peer_id not in unfit
    forwarded = liar.get("/v0/inference")["serving"]["forwarded"]
    for i in range(3):
        generate(gateway, [*PROMPT, 100 + i], 8)
    assert liar.get("/v0/inference")["serving"]["forwarded"] == forwarded  # avoided


MOE_LAYERS, MOE_EXPERTS = 4, 8


def experts(lo: int, hi: int) -> list[str]:
    return [f"experts:{layer}:{lo}-{hi}" for layer in range(MOE_LAYERS)]


def test_a_lying_expert_worker_is_caught_within_the_predicted_calls_and_avoided(
        localnet: Callable[..., LocalNet], tmp_path: Path) -> None:
    """The stage (the gateway's node) holds every layer's dense path; three workers hold
    every expert, node 1 lies. The stage checks and keeps the evidence."""
    model = make_model(tmp_path / "moe.gguf", n_layer=MOE_LAYERS, n_expert=MOE_EXPERTS,
                       n_expert_used=2, n_embd=128, n_head=8, n_head_kv=4, head_dim=128,
                       n_ff_exp=768, dtype="f32", tied_output=True)
    net = start(localnet, model, [["head", f"layers:0-{MOE_LAYERS}"], experts(0, 8),
                                  experts(0, 8), experts(0, 8)], {1: "lying-experts"})
    gateway, liar = net.nodes[0], net.nodes[1]
    caught_within(gateway, "experts", WORKER_CALLS)
    assert [e["peer"] for e in spot(gateway)["evidence"]] == [liar.peer_id]
    evidence = spot(gateway)["evidence"][0]
    assert evidence["kind"] == "experts"
    assert evidence["sessions"] <= WORKER_CALLS
    assert kept(gateway)[0]["peer"] == liar.peer_id
    assert liar.peer_id in gateway.get("/v0/inference")["unfit"]
    rows = liar.get("/v0/inference")["serving"]["expert_rows"]
    generate(gateway, PROMPT, 8)
    assert liar.get("/v0/inference")["serving"]["expert_rows"] == rows  # avoided

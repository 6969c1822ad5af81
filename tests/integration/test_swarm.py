"""Generation across real daemons on 127.0.0.1: ring routes, remote experts, failover.

Placement is pinned with ``market.hold`` and a budget just big enough for the pins: every
unit of the models used is over 1 MiB, so the budget's rounding slack (< 1 MiB) can never
enroll a node into anything else, and every run places the same way. The reference is
one daemon holding everything.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from faulty_daemon import command  # type: ignore[import-not-found]

from kvasird.inference.errors import FAILED_S
from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LocalNode
from kvasird.localnet.placement import pinned
from kvasird.model.bundled import bundled_path
from kvasird.model.manifest import Manifest
from kvasird_dev.testmodels import make_model

pytestmark = pytest.mark.slow

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [28, 1834, 253, 2145, 30], [46, 9, 3, 812, 1147, 288, 2]]
N_TOKENS = 12
ROUTED_S = 90.0


def settings(model: Path, pins: list[str], **extra: Any) -> dict[str, Any]:
    return pinned(model, pins, **{"inference.expert_timeout_s": 6.0, **extra})


def start(localnet: Callable[..., LocalNet], model: Path, placement: list[list[str]],
          perturb: frozenset[int] = frozenset(), by_id: frozenset[int] = frozenset(),
          **extra: Any) -> LocalNet:
    """A net whose node i holds placement[i]; nodes in `perturb` return wrong expert outputs;
    nodes in `by_id` name the model by its id (they fetch what they hold from the others)
    instead of importing the file."""
    net = localnet(len(placement))
    previous = ""
    model_id = Manifest.from_gguf(model).model_id
    for node, pins in zip(net.nodes, placement, strict=True):
        net.settings = {**net.settings, **settings(model, pins, **extra)}
        if node.index in by_id:
            net.settings["market.model"] = model_id
        previous = net.configure(node, [previous] if previous else [])
    for node in net.nodes:
        if node.index in perturb:
            node.command = command("lying-experts")
        node.spawn()
    for node in net.nodes:
        node.wait_ready()
    net.wait_until("the gateway sees every node's holdings online",
                   lambda: all_online(net.nodes[0], len(placement)), ROUTED_S)
    net.wait_until("the gateway has a route", lambda: routable(net.nodes[0]), ROUTED_S)
    return net


def all_online(node: LocalNode, n: int) -> bool:
    """`node` has the records of n holders (itself included), every holding online: a
    replica a test fails over to is in its map, not still loading."""
    holders = node.get("/v0/coverage").get("holders") or {}
    return len(holders) == n and all(
        h["holdings"] and all(x[-1] == "online" for x in h["holdings"]) for h in holders.values())


def routable(node: LocalNode) -> bool:
    body = {"prompt": [1], "max_tokens": 1}
    url = node.home.admin_address()
    return url is not None and httpx.post(url + "/v0/generate", json=body,
                                          timeout=30).status_code == 200


def generate(node: LocalNode, prompt: list[int], n: int = N_TOKENS,
             on_token: Callable[[int], None] | None = None) -> list[int]:
    return [e["token"] for e in events(node, prompt, n, on_token)]


def events(node: LocalNode, prompt: list[int], n: int = N_TOKENS,
           on_token: Callable[[int], None] | None = None,
           logprobs: int = 0) -> list[dict[str, Any]]:
    """The token events of a greedy generation through `node`'s admin API."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": logprobs}
    out: list[dict[str, Any]] = []
    with httpx.stream("POST", node.home.admin_address() + "/v0/generate", json=body,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            event = json.loads(line)
            assert "error" not in event, f"{event}\nthe gateway's warnings:\n{warnings(node)}"
            if "token" in event:
                out.append(event)
                if on_token:
                    on_token(len(out))
    return out


def warnings(node: LocalNode, lines: int = 20) -> str:
    """The last warnings and errors in `node`'s log (what a failed generation went through)."""
    logged = node.log.read_text(errors="replace").splitlines()
    return "\n".join([x for x in logged if '"level": "warning"' in x
                      or '"level": "error"' in x][-lines:])


def kvasird(node: LocalNode, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvasird", "--home", str(node.home.root), *args],
                          capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
def bundled() -> Path:
    return bundled_path()


@pytest.fixture(scope="module")
def reference(bundled: Path, module_tmp: Callable[[str], Path]) -> list[list[int]]:
    """Greedy tokens of one daemon holding the whole bundled model."""
    net = LocalNet(module_tmp("one"), 1)
    with net:
        start(lambda n: net, bundled, [["head", "layers:0-30"]])
        return [generate(net.nodes[0], p) for p in PROMPTS]


def test_ring_without_lanes_through_windows_that_overlap_generates_the_same_tokens(
        localnet: Callable[..., LocalNet], bundled: Path, reference: list[list[int]]) -> None:
    """Over libp2p streams only; the windows overlap (a market's replicas need not meet at
    a boundary), so the route enters the second and third past their starts."""
    net = start(localnet, bundled, [["head", "layers:0-12"], ["layers:8-22"], ["layers:18-30"]],
                **{"inference.lanes": False})
    assert [generate(net.nodes[0], p) for p in PROMPTS] == reference
    view = net.nodes[0].get("/v0/inference")["lanes"]
    assert view["open_to"] == [] and view["port"] is None
    assert set(view["libp2p_to"]) == {net.nodes[1].peer_id, net.nodes[2].peer_id}


def test_a_ring_speculating_with_a_draft_model_generates_the_same_tokens(
        localnet: Callable[..., LocalNet], bundled: Path, reference: list[list[int]]) -> None:
    """The gateway drafts with a model of the served one's vocabulary (here the bundled
    model itself, so nearly every guess is accepted) and the ring checks the guesses in
    one pass: the tokens are those of one daemon decoding without guesses."""
    net = start(localnet, bundled, [["head", "layers:0-10"], ["layers:10-20"], ["layers:20-30"]],
                **{"inference.speculate": "draft", "inference.draft_model": str(bundled),
                   "inference.draft_k": 4})
    gateway = net.nodes[0]
    net.wait_until("the gateway loaded its draft model", lambda: gateway.get(
        "/v0/inference")["speculation"]["draft_model"] is not None, ROUTED_S)
    assert [generate(gateway, p) for p in PROMPTS] == reference
    spent = gateway.get("/v0/inference")["speculation"]
    assert spent["steps"] > 0 and spent["accepted"] >= 0.8 * spent["guessed"] > 0, spent


STEP_TIMEOUT_S = 30.0


@pytest.mark.parametrize(("window", "sig"), [(1, signal.SIGKILL), (2, signal.SIGKILL),
                                            (1, signal.SIGSTOP)],
                         ids=["middle stage killed", "last stage killed", "middle stage hung"])
def test_killed_stage_is_replaced_and_the_output_is_unchanged(
        localnet: Callable[..., LocalNet], bundled: Path, reference: list[list[int]],
        window: int, sig: signal.Signals) -> None:
    """Node 3 replicates the window of node `window`; whichever of the two is on the route
    is killed (or stopped) mid-generation, while boundaries go stage to stage. The step in
    flight never comes back (a write to a socket whose peer just died still succeeds): the
    gateway's probe of the route finds the dead or silent hop, well before the step timeout
    (30 s here: a whole generation on a busy 2-core machine, failover included, once took
    10.1 s, past the 10 s the other tests use, with the probe doing its work)."""
    windows = [["head", "layers:0-10"], ["layers:10-20"], ["layers:20-30"]]
    net = start(localnet, bundled, [*windows, windows[window]],
                **{"inference.step_timeout_s": STEP_TIMEOUT_S})
    gateway = net.nodes[0]
    killed: list[str] = []

    def kill_after(n: int) -> None:
        if n == 3 and not killed:
            route = next(iter(gateway.get("/v0/inference")["generations"].values()))["route"]
            victim = next(x for x in net.nodes[1:]
                          if x.peer_id in route and x.index in (window, 3))
            killed.append(victim.peer_id)
            victims.append(victim)
            victim.signal(sig)

    victims: list[LocalNode] = []
    began = time.monotonic()
    got = generate(gateway, PROMPTS[0], on_token=kill_after)
    took = time.monotonic() - began
    for victim in victims:
        victim.signal(signal.SIGKILL)  # a stopped daemon would not heed the SIGTERM of stop()
    assert got == reference[0]
    # before the sentence's check: a first sentence lasts FAILED_S (15 s), so a generation
    # slower than that would otherwise fail there, saying nothing of why
    assert took < FAILED_S, (f"the generation took {took:.1f} s: its failover did not "
                               f"come from the probe, well before the {STEP_TIMEOUT_S:g} s "
                               "step timeout")
    assert killed and killed[0] in gateway.get("/v0/inference")["unfit"]


# --- qwen3moe: stages hold the dense paths, other daemons the experts --------------------

MOE_LAYERS, MOE_EXPERTS = 4, 8
MOE_PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7, 7, 7, 7]]


def experts(lo: int, hi: int) -> list[str]:
    return [f"experts:{layer}:{lo}-{hi}" for layer in range(MOE_LAYERS)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every unit over 1 MiB: an expert is 3 x 128 x 768 f32, a dense path ~1.6 MB."""
    return make_model(tmp_path_factory.mktemp("moe") / "moe.gguf", n_layer=MOE_LAYERS,
                      n_expert=MOE_EXPERTS, n_expert_used=2, n_embd=128, n_head=8,
                      n_head_kv=4, head_dim=128, n_ff_exp=768, dtype="f32", tied_output=True)


@pytest.fixture(scope="module")
def moe_reference(moe: Path, module_tmp: Callable[[str], Path]) -> list[list[int]]:
    net = LocalNet(module_tmp("moe-one"), 1)
    with net:
        start(lambda n: net, moe, [["head", f"layers:0-{MOE_LAYERS}", *experts(0, MOE_EXPERTS)]])
        return [generate(net.nodes[0], p) for p in MOE_PROMPTS]


def expert_rows(node: LocalNode) -> int:
    return int(node.get("/v0/inference")["serving"]["expert_rows"])


def test_moe_stages_with_remote_experts_generate_the_tokens_of_one_node(
        localnet: Callable[..., LocalNet], moe: Path, moe_reference: list[list[int]]) -> None:
    net = start(localnet, moe, [["head", "layers:0-2"], ["layers:2-4"], experts(0, 4),
                                experts(4, 8)])
    got = [generate(net.nodes[0], p) for p in MOE_PROMPTS]
    assert got == moe_reference
    assert expert_rows(net.nodes[2]) > 0 and expert_rows(net.nodes[3]) > 0
    # the prompts at once: the stages interleave the sessions' steps and send their rows
    # for a worker as one message when they meet (a run here: 16 of 522 rows went in
    # another session's message); every session still gets exactly its tokens
    with concurrent.futures.ThreadPoolExecutor(len(MOE_PROMPTS)) as pool:
        together = list(pool.map(lambda p: generate(net.nodes[0], p), MOE_PROMPTS))
    assert together == moe_reference


def test_killed_expert_worker_is_replaced_and_the_output_is_unchanged(
        localnet: Callable[..., LocalNet], moe: Path, moe_reference: list[list[int]]) -> None:
    net = start(localnet, moe, [["head", "layers:0-4"], experts(0, 4), experts(0, 4),
                                experts(4, 8)])
    gateway = net.nodes[0]
    killed: list[LocalNode] = []

    def kill_after(n: int) -> None:
        if n == 3 and not killed:
            victim = max(net.nodes[1:3], key=expert_rows)
            killed.append(victim)
            victim.signal(signal.SIGKILL)

    got = generate(gateway, MOE_PROMPTS[0], on_token=kill_after)
    assert got == moe_reference[0]

    # The gateway notices: it sentences the dead worker when it next picks it, or drops it
    # from its map once its record expires. (The victim is the busier replica so far; on a
    # loaded machine latencies shift and the other one may be picked from then on, so the
    # dead one was sometimes never tried before the generation ended.)
    def noticed() -> bool:
        assert generate(gateway, MOE_PROMPTS[0]) == moe_reference[0]
        return killed[0].peer_id in gateway.get("/v0/inference")["unfit"] \
            or killed[0].peer_id not in gateway.get("/v0/coverage")["holders"]

    net.wait_until("the gateway avoids the killed worker", noticed, ROUTED_S)


def test_perturbing_worker_is_caught_by_spot_checks_and_routed_around(
        localnet: Callable[..., LocalNet], moe: Path, moe_reference: list[list[int]]) -> None:
    net = start(localnet, moe, [["head", "layers:0-4"], experts(0, 8), experts(0, 8),
                                experts(0, 8)],
                perturb=frozenset({1}),
                **{"inference.spot_check": 1.0, "inference.unfit_quorum": 1})
    gateway = net.nodes[0]
    got = [generate(gateway, p) for p in MOE_PROMPTS]
    assert got == moe_reference
    view = gateway.get("/v0/inference")
    assert net.nodes[1].peer_id in view["unfit"]
    assert view["dispatch"]["caught"] >= 1
    net.wait_until("the verdict reaches the other nodes over gossip",
                   lambda: all(net.nodes[1].peer_id in n.get("/v0/inference")["unfit"]
                               for n in net.nodes[2:]), timeout=15)
    rows = expert_rows(net.nodes[1])
    generate(gateway, MOE_PROMPTS[0])
    assert expert_rows(net.nodes[1]) == rows


def test_hot_experts_are_cached_by_the_stage_and_the_output_is_unchanged(
        localnet: Callable[..., LocalNet], moe: Path, moe_reference: list[list[int]]) -> None:
    """The stage names the model by id: it holds the bytes of its window only, and fetches
    the experts it caches from the workers."""
    net = start(localnet, moe, [["head", "layers:0-4"], experts(0, 4), experts(4, 8)],
                by_id=frozenset({0}), **{"inference.hot_experts": 6, "inference.hot_after": 3})
    def dispatch() -> dict:
        return net.nodes[0].get("/v0/inference")["dispatch"]

    got = [generate(net.nodes[0], p) for p in MOE_PROMPTS]
    assert got == moe_reference
    # The experts selected often enough are fetched in the background, by then or soon after.
    net.wait_until("the stage has cached hot experts", lambda: dispatch().get("hot_fetched", 0)
                   > 0, timeout=60)
    assert [generate(net.nodes[0], p) for p in MOE_PROMPTS] == moe_reference
    assert dispatch()["hot_rows"] > 0 and dispatch()["calls"] > 0
    model = net.nodes[0].get("/v0/shards")["models"][0]
    assert model["held_bytes"] < model["total_bytes"]  # its window and the cached experts


def test_a_stage_with_its_own_copy_of_the_experts_sends_them_out_only_when_told_faster(
        localnet: Callable[..., LocalNet], moe: Path, moe_reference: list[list[int]]) -> None:
    """A stage holding its layers' experts (a fallback replica) beside two workers: on
    loopback its own compute (microseconds at these widths) beats any round trip, so every
    layer of every step stays here and the workers compute nothing; told to prefer the
    workers ([inference] expert_choice = "remote"), the same stage sends every layer out,
    with the same tokens."""
    placement = [["head", "layers:0-4", *experts(0, MOE_EXPERTS)], experts(0, 4), experts(4, 8)]
    for mode in ("auto", "remote"):
        net = start(localnet, moe, placement, **{"inference.expert_choice": mode})

        def weighed() -> bool:
            """The stage knows who would take each layer (the workers' holdings count once
            their proofs are checked): it weighed them against its own copy."""
            assert generate(net.nodes[0], MOE_PROMPTS[0]) == moe_reference[0]
            choice = net.nodes[0].get("/v0/inference")["expert_choice"]
            if mode == "remote":
                return all(c.get("remote", 0) > 0 for c in choice["layers"].values())
            return len(choice["estimates"]) == MOE_LAYERS and all(
                e["theirs_ms"] is not None for e in choice["estimates"].values())

        net.wait_until("the stage weighs the workers", weighed, ROUTED_S)
        got = [generate(net.nodes[0], p) for p in MOE_PROMPTS]
        assert got == moe_reference
        choice = net.nodes[0].get("/v0/inference")["expert_choice"]
        assert choice["mode"] == mode
        assert sorted(choice["layers"]) == [str(layer) for layer in range(MOE_LAYERS)]
        worked = [expert_rows(node) for node in net.nodes[1:]]
        if mode == "auto":
            assert all(set(c) == {"fallback"} for c in choice["layers"].values()), choice
            assert worked == [0, 0]
        else:
            assert all(c.get("remote", 0) > 0 for c in choice["layers"].values()), choice
            assert all(w > 0 for w in worked), worked
        net.down()


# --- one three-stage ring for the last tests (kept until the module ends) ------------

@pytest.fixture(scope="module")
def ring(bundled: Path, module_tmp: Callable[[str], Path]) -> Iterator[LocalNet]:
    """Three stages of ten layers each, shared by the tests that leave every stage running.
    Their steps batch however short they compute ([inference] batch_min_ms 0: the
    bundled model's hops take ~2 ms, under the default), each hop every session stepping
    there (batch_pipelined false: with the default, a hop whose sessions are away for over
    five times its compute, as the gateway's first hop on a busy machine, batches none)."""
    net = LocalNet(module_tmp("ring"), 3)
    with net:
        yield start(lambda n: net, bundled, [["head", "layers:0-10"], ["layers:10-20"],
                                             ["layers:20-30"]],
                    **{"inference.batch_min_ms": 0.0, "inference.batch_pipelined": False})


def test_three_stage_ring_generates_the_tokens_of_one_node(
        ring: LocalNet, reference: list[list[int]]) -> None:
    net = ring
    got = [generate(net.nodes[0], p) for p in PROMPTS]
    assert got == reference
    cli = kvasird(net.nodes[0], "generate", "--tokens", ",".join(map(str, PROMPTS[0])),
                  "--max-tokens", str(N_TOKENS))
    assert [int(t) for t in cli.stdout.split()] == reference[0]
    text = kvasird(net.nodes[0], "generate", "--chat", "What is the capital of France?",
                   "--max-tokens", "8")
    assert text.returncode == 0 and text.stdout.strip() and "generated tokens" in text.stderr
    route = net.nodes[0].get("/v0/inference")
    assert route["generations"] == {}
    assert route["serving"]["sessions"] == 0
    # the hops go over lanes (direct TCP keyed over libp2p) once they are up; a lane whose
    # first attempt failed (two peers dialling each other at start-up) is asked for again
    # within seconds, on the next use
    peers = {net.nodes[1].peer_id, net.nodes[2].peer_id}

    def lanes_up() -> bool:
        lanes = net.nodes[0].get("/v0/inference")["lanes"]
        if set(lanes["open_to"]) == peers and lanes["libp2p_to"] == []:
            return True
        generate(net.nodes[0], [1], 1)  # a use: a lane due for another attempt is asked for
        return False

    net.wait_until("lanes to both remote stages", lanes_up, 30)
    assert all(n.get("/v0/inference")["lanes"]["accepted"] >= 1 for n in net.nodes[1:])
    # boundaries went stage to stage: each remote stage sent its output on itself
    assert all(n.get("/v0/inference")["serving"]["forwarded"] >= N_TOKENS for n in net.nodes[1:])
    # traced steps split the step's time per hop on the real route
    breakdown = net.nodes[0].get("/v0/inference")["breakdown"]
    assert breakdown["route"] == [n.peer_id for n in (*net.nodes, net.nodes[0])]
    assert breakdown["steps"] >= 2 and all(h["compute_ms"] > 0 for h in breakdown["hops"])


def test_concurrent_generations_decode_in_batches_at_every_stage(
        ring: LocalNet, reference: list[list[int]]) -> None:
    """Six generations at once through the ring: each hop computes the decode steps of
    the sessions that reach it together as one graph, and every generation still has the
    tokens it has alone."""
    net = ring
    before = [n.get("/v0/inference")["serving"]["batches"] for n in net.nodes]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: generate(net.nodes[0], p), prompts))
    assert got == [reference[i % len(PROMPTS)] for i in range(6)]
    after = [n.get("/v0/inference")["serving"]["batches"] for n in net.nodes]
    for node, a, b in zip(net.nodes, before, after, strict=True):
        assert b["batches"] > a["batches"] and b["largest"] >= 2, (node.index, a, b)


def test_a_client_that_goes_away_frees_every_session_on_the_route(ring: LocalNet) -> None:
    net = ring
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0}
    with httpx.stream("POST", net.nodes[0].home.admin_address() + "/v0/generate", json=body,
                      timeout=60) as resp:
        lines = resp.iter_lines()
        next(lines), next(lines)
        assert all(n.get("/v0/inference")["serving"]["sessions"] > 0 for n in net.nodes)
    net.wait_until("every stage closed its session",
                   lambda: all(n.get("/v0/inference")["serving"]["sessions"] == 0
                               for n in net.nodes), timeout=10)

"""A Qwen3.5-style hybrid (qwen35moe: gated delta-net layers with a recurrent state beside
full-attention layers, routed experts and a shared one) through real daemons: the stage
holding delta-net layers is SIGKILLed mid-generation, its replica takes over, and the
replayed history rebuilds the recurrent state, so the greedy output is the undisturbed
run's token for token."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from test_swarm import events, start  # type: ignore[import-not-found]

from kvasird.localnet import LocalNet
from kvasird.localnet.launcher import LocalNode
from kvasird_dev.testmodels import make_model

pytestmark = pytest.mark.slow

N_LAYER, N_EXPERT = 8, 8
PROMPT = [1, 504, 3458, 282, 4649, 314, 9052, 30]
N_TOKENS = 16
TOP = 3


def run(node: LocalNode, on_token: Callable[[int], None] | None = None
        ) -> tuple[list[int], list[list[float]]]:
    """Greedy tokens and each one's top log-probabilities, through ``node``'s gateway."""
    got = events(node, PROMPT, N_TOKENS, on_token, logprobs=TOP)
    return [e["token"] for e in got], [[e["logprob"], *(lp for _, lp in e["top"])] for e in got]


def same(a: tuple[list[int], list[list[float]]], b: tuple[list[int], list[list[float]]]) -> bool:
    return a[0] == b[0] and all(abs(x - y) < 1e-4 for p, q in zip(a[1], b[1], strict=True)
                                for x, y in zip(p, q, strict=True))


def units(a: int, b: int) -> list[str]:
    return [f"layers:{a}-{b}", *(f"experts:{layer}:0-{N_EXPERT}" for layer in range(a, b))]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 0-2 and 4-6 are delta-nets, 3 and 7 attend; every unit over 1 MiB (f32,
    wide heads and experts), so a pinned node's budget enrolls it in nothing else; an
    output matrix of its own, so that greedy tokens vary (a tied one repeats a token)."""
    return make_model(tmp_path_factory.mktemp("hybrid") / "qwen35moe.gguf", arch="qwen35moe",
                      n_layer=N_LAYER, n_expert=N_EXPERT, n_expert_used=2, n_embd=128, n_head=8,
                      n_head_kv=4, head_dim=128, n_ff_exp=768, dtype="f32", tied_output=False)


def test_a_killed_delta_net_stage_is_replaced_and_the_output_is_unchanged(
        localnet: Callable[..., LocalNet], hybrid: Path,
        module_tmp: Callable[[str], Path]) -> None:
    one = LocalNet(module_tmp("one"), 1)
    with one:
        start(lambda n: one, hybrid, [["head", *units(0, N_LAYER)]])
        reference = run(one.nodes[0])
    assert len(set(reference[0])) > N_TOKENS // 2
    net = start(localnet, hybrid, [["head", *units(0, 4)], units(4, N_LAYER), units(4, N_LAYER)])
    gateway = net.nodes[0]
    assert same(run(gateway), reference)  # undisturbed, split
    killed: list[LocalNode] = []
    sentenced: list[bool] = []

    def kill_after(n: int) -> None:
        if n == N_TOKENS // 2 and not killed:
            route = next(iter(gateway.get("/v0/inference")["generations"].values()))["route"]
            victim = next(x for x in net.nodes[1:] if x.peer_id in route)
            killed.append(victim)
            victim.signal(signal.SIGKILL)
        elif killed and not sentenced:  # seen while the generation runs on: a sentence
            if killed[0].peer_id in gateway.get("/v0/inference")["unfit"]:  # lasts seconds,
                sentenced.append(True)  # the rest of a generation may take longer

    got = run(gateway, on_token=kill_after)
    assert killed, "the generation ended before the kill"
    assert same(got, reference), (got, reference)
    assert sentenced, "the killed stage was never avoided"

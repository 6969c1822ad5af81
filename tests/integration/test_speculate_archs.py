"""Speculative decoding through a 3-node ring, for each architecture the engine serves.

Three daemons hold a generated model's layers in three windows (the head on the first);
the first drafts with a smaller model of the same architecture and vocabulary (the first
half of the served model's layers, so that some guesses are right and some wrong) and the
ring checks four guesses a step. Its greedy tokens are those of one process of ours
decoding one token a step: a wrong guess rolls every stage back past it, attention's KV,
sliding windows' rings and delta-net states alike, and the rows kept are the rows a decode
step computes. Each hop hands each row of a check on as soon as it computed it (Step.part),
so the hops after the first take a check's rows one at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_archs_localnet import PROMPT, SHAPES  # type: ignore[import-not-found]
from test_swarm import ROUTED_S, generate, start  # type: ignore[import-not-found]

from kvasird.compute.stage import Stage
from kvasird.localnet import LocalNet
from kvasird_dev.testmodels import make_model

pytestmark = pytest.mark.slow

N_TOKENS = 24
N_LAYER = 12
MIDWAY = [20146, 24266, 38829, 29180, 25291, 21745, 22397, 37403, 11095, 32634, 26835, 111]
"""A prompt whose answer the qwen35 draft guesses right for a while, then wrong, in steps of
four guesses: 1, 1, 4, 4, 3, 2, 3 kept."""


OTHER_DRAFT = frozenset({"qwen3", "mixtral", "gemma3"})
"""Architectures whose half-depth draft guesses every token of the prompt right (a random
model with a tied output mostly repeats a token): drafted by one with an output matrix of
its own, wrong every time."""


def model(arch: str, path: Path, n_layer: int, tied_output: bool = True) -> Path:
    """The served model, or a draft: the same seed draws the same embedding and first
    layers, so a half-depth model of the served one is right often enough to be kept and
    wrong often enough to roll back."""
    return make_model(path, arch=arch, n_layer=n_layer, n_embd=128, n_head=4, n_head_kv=2,
                      head_dim=32, dtype="q8_0", seed=7,
                      **{"tied_output": tied_output, **SHAPES[arch]})


def greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """One stage of this process holding the whole model, one token a step."""
    stage = Stage.load(path, threads=1)
    tokens: list[int] = []
    try:
        with stage.open_session() as s:
            logits = stage.forward(s, np.asarray(prompt, np.int64))[-1]
            for _ in range(n):
                tokens.append(int(np.argmax(logits)))
                logits = stage.forward(s, np.asarray(tokens[-1:], np.int64))[-1]
    finally:
        stage.close()
    return tokens


def window(arch: str, i: int) -> list[str]:
    """The pins of the i-th third of the layers, a MoE's experts of them included."""
    lo, hi = i * N_LAYER // 3, (i + 1) * N_LAYER // 3
    n_expert = SHAPES[arch].get("n_expert", 0)
    return [f"layers:{lo}-{hi}", *(f"experts:{la}:0-{n_expert}" for la in range(lo, hi)
                                   if n_expert)]


@pytest.mark.parametrize("arch", list(SHAPES))
def test_a_ring_speculating_answers_as_one_process_decoding_alone(
        arch: str, tmp_path: Path, localnet: Callable[..., LocalNet]) -> None:
    speculating(arch, tmp_path, localnet)


def test_a_delta_net_hop_short_of_state_slots_replays_into_the_guesses(
        tmp_path: Path, localnet: Callable[..., LocalNet]) -> None:
    """Two state slots a stage: a session's own and one copy, so a step going back past
    the first guess finds no copy there; the hop goes back to the copy it kept and
    recomputes the rows since, and the tokens are still those of one process."""
    # the draft's guesses of this prompt's answer go wrong after one, two or three right
    net = speculating("qwen35", tmp_path, localnet, MIDWAY, **{"inference.state_slots": 2})
    replayed = [n.get("/v0/inference")["serving"]["replayed"] for n in net.nodes]
    assert sum(replayed) > 0, replayed


def speculating(arch: str, tmp_path: Path, localnet: Callable[..., LocalNet],
                prompt: list[int] = PROMPT, **extra: object) -> LocalNet:
    """The ring of `arch` drafting four guesses a step: its greedy tokens equal one
    process's, some guesses were rejected (every stage went back past them)."""
    path = model(arch, tmp_path / f"{arch}.gguf", N_LAYER)
    draft = model(arch, tmp_path / f"{arch}-draft.gguf", N_LAYER // 2,
                  tied_output=arch not in OTHER_DRAFT)
    net = start(localnet, path, [["head", *window(arch, 0)], window(arch, 1), window(arch, 2)],
                **{"inference.speculate": "draft", "inference.draft_model": str(draft),
                   "inference.draft_k": 4, **extra})
    gateway = net.nodes[0]
    net.wait_until("the gateway loaded its draft model", lambda: gateway.get(
        "/v0/inference")["speculation"]["draft_model"] is not None, ROUTED_S)
    before = gateway.get("/v0/inference")["speculation"]
    got = generate(gateway, prompt, N_TOKENS)
    spent = gateway.get("/v0/inference")["speculation"]
    assert got == greedy(path, prompt, N_TOKENS)
    guessed, accepted = (spent[k] - before[k] for k in ("guessed", "accepted"))
    print(f"{arch}: {spent['steps'] - before['steps']} steps, {accepted} of {guessed} "
          f"guesses kept")
    # some guesses checked and rejected: every stage went back past them
    assert spent["steps"] > before["steps"] and 0 <= accepted < guessed, spent
    # the hops after the first computed each check's rows as the hop before sent each one
    apart = [n.get("/v0/inference")["serving"]["rows_apart"] for n in net.nodes]
    assert apart[1] > 0 and apart[2] > 0, apart
    return net

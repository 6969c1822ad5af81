"""Logit bias and the repetition, frequency and presence penalties of the sampler, their
wire form, and drawing from several rows of one step (speculative decoding)."""

from __future__ import annotations

import numpy as np
import pytest

from kvasird.compute.errors import InputError
from kvasird.compute.sampling import Sampler, SamplingParams
from kvasird.errors import WireError
from kvasird.inference.protocol.stage import sampling_from_wire, sampling_to_wire
from kvasird.wire.framing import pack, unpack


def reference(logits: np.ndarray, history: list[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's logit-bias then penalties samplers, token by token in float32 as its C
    code reads (src/llama-sampler.cpp), over the last penalty_last_n tokens of history."""
    z = np.array(logits, np.float32)
    for token, value in p.logit_bias:
        z[token] += np.float32(value)
    window = history[-p.penalty_last_n :] if p.penalty_last_n else []
    for token in set(window):
        count = np.float32(window.count(token))
        if z[token] <= 0:
            z[token] *= np.float32(p.repetition_penalty)
        else:
            z[token] /= np.float32(p.repetition_penalty)
        z[token] -= count * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
    return z


def test_a_bias_of_100_makes_greedy_pick_that_token_and_minus_100_bans_it() -> None:
    z = np.array([3.0, 1.0, -2.0, 0.5], np.float32)
    assert Sampler(SamplingParams(logit_bias=((2, 100.0),)))(z) == 2
    assert Sampler(SamplingParams(logit_bias=((0, -100.0),)))(z) == 1


def test_a_bias_moves_the_seeded_draw_towards_the_token() -> None:
    z = np.zeros(8, np.float32)
    biased = Sampler(SamplingParams(temperature=1.0, seed=4, logit_bias=((5, 4.0),)))
    draws = [biased(z) for _ in range(400)]
    assert draws.count(5) > 300  # e^4 / (e^4 + 7) = 0.89


def test_presence_penalises_a_seen_token_once_and_frequency_once_per_occurrence() -> None:
    z = np.array([2.0, 1.0, 0.0], np.float32)
    history = [0, 0, 0]
    assert Sampler(SamplingParams(presence_penalty=0.9))(z, history) == 0
    assert Sampler(SamplingParams(presence_penalty=1.1))(z, history) == 1
    assert Sampler(SamplingParams(frequency_penalty=0.3))(z, history) == 0
    assert Sampler(SamplingParams(frequency_penalty=0.4))(z, history) == 1


def test_negative_penalties_favour_what_was_said() -> None:
    z = np.array([1.0, 2.0], np.float32)
    assert Sampler(SamplingParams(presence_penalty=-2.0))(z, [0]) == 0
    assert Sampler(SamplingParams(frequency_penalty=-0.6))(z, [0, 0]) == 0


def test_penalties_count_only_the_last_penalty_last_n_tokens_prompt_included() -> None:
    z = np.array([2.0, 1.0, 0.0], np.float32)
    said_long_ago = [0] + [2] * 64
    assert Sampler(SamplingParams(presence_penalty=2.0))(z, said_long_ago) == 0
    assert Sampler(SamplingParams(presence_penalty=2.0, penalty_last_n=65))(z, said_long_ago) == 1
    assert Sampler(SamplingParams(presence_penalty=2.0, penalty_last_n=0))(z, [0]) == 0


@pytest.mark.parametrize("seed", range(20))
def test_greedy_with_bias_and_penalties_picks_the_reference_argmax(seed: int) -> None:
    """Logits close together over a small vocabulary and a history longer than the window:
    any slip in the order, the window or the arithmetic moves the argmax somewhere."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        logits = rng.normal(0, 1, 40).astype(np.float32)
        history = rng.integers(0, 40, int(rng.integers(0, 120))).tolist()
        p = SamplingParams(
            repetition_penalty=float(rng.uniform(0.5, 2.0)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            presence_penalty=float(rng.uniform(-2, 2)),
            penalty_last_n=int(rng.integers(1, 100)),
            logit_bias=tuple(
                (int(t), float(rng.uniform(-3, 3)))
                for t in rng.choice(40, int(rng.integers(0, 5)), replace=False)
            ),
        )
        assert Sampler(p)(logits, history) == int(np.argmax(reference(logits, history, p)))


def test_a_bias_on_a_token_past_the_logits_is_ignored() -> None:
    z = np.array([1.0, 2.0], np.float32)
    assert Sampler(SamplingParams(logit_bias=((7, 100.0),)))(z) == 1


def test_the_grammar_mask_holds_against_a_bias() -> None:
    class OnlyZero:
        def allowed(self, generated: object) -> np.ndarray:
            return np.array([True, False])

        def consume(self, token: int) -> None:
            pass

    sampler = Sampler(SamplingParams(logit_bias=((1, 100.0),)), OnlyZero())
    assert sampler(np.array([0.0, 1.0], np.float32)) == 0


def test_drawing_from_several_rows_of_one_step_gives_the_tokens_of_one_step_per_row() -> None:
    """The rows a verifying step returns (each computed after the previous row's token) are
    the rows single steps would have returned: one call per row, each token appended to the
    history before the next, draws what the single steps drew."""
    vocab, prompt = 30, [1, 2, 3, 3]

    def row(history: list[int]) -> np.ndarray:
        return np.random.default_rng(sum(history) * 31 + len(history)).normal(0, 1, vocab)

    p = SamplingParams(
        temperature=0.8, seed=9, frequency_penalty=0.7, presence_penalty=0.4, penalty_last_n=6
    )
    single, history = Sampler(p), list(prompt)
    for _ in range(8):
        history.append(single(row(history), history))
    drawn = history[len(prompt) :]
    rows = [row(prompt + drawn[:i]) for i in range(8)]
    batched, history = Sampler(p), list(prompt)
    for r in rows:
        history.append(batched(r, history))
    assert history[len(prompt) :] == drawn


@pytest.mark.parametrize(
    "bad",
    [
        dict(frequency_penalty=2.5),
        dict(presence_penalty=-2.5),
        dict(presence_penalty=float("nan")),
        dict(penalty_last_n=-1),
        dict(logit_bias=((3, 101.0),)),
        dict(logit_bias=((3, float("inf")),)),
        dict(logit_bias=((-1, 1.0),)),
        dict(logit_bias=((3, 1.0), (3, 2.0))),
    ],
)
def test_bad_penalties_and_biases_are_refused(bad: dict) -> None:
    with pytest.raises(InputError):
        SamplingParams(**bad)


def test_penalties_and_bias_travel_on_the_wire_and_old_maps_read_as_defaults() -> None:
    p = SamplingParams(
        temperature=0.5,
        frequency_penalty=0.25,
        presence_penalty=-1.0,
        penalty_last_n=128,
        logit_bias=((5, -100.0), (9, 2.5)),
        seed=3,
    )
    assert sampling_from_wire(unpack(pack(sampling_to_wire(p))), "s") == p
    assert sampling_from_wire(sampling_to_wire(p), "s") == p  # a route to this node: no codec
    old = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, "seed": None}
    assert sampling_to_wire(SamplingParams()) == old
    assert sampling_from_wire(old, "s") == SamplingParams()


@pytest.mark.parametrize(
    "extra",
    [
        {"logit_bias": [[5, "x"]]},
        {"logit_bias": [[5]]},
        {"logit_bias": [[-5, 1.0]]},
        {"logit_bias": [[5, 1.0], [5, 1.0]]},
        {"logit_bias": [[5, 150.0]]},
        {"presence_penalty": 3.0},
        {"penalty_last_n": -2},
    ],
)
def test_a_bad_sampling_map_from_a_peer_names_the_field(extra: dict) -> None:
    base = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, "seed": None}
    with pytest.raises(WireError, match="sampling"):
        sampling_from_wire({**base, **extra}, "stage.sampling")

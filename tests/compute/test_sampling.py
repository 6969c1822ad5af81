"""Sampling: greedy, seeded determinism, the filters, and refusal of bad settings."""

from __future__ import annotations

import numpy as np
import pytest

from kvasird.compute.errors import InputError
from kvasird.compute.sampling import LLAMA_SERVER, Recommended, Sampler, SamplingParams, log_softmax

LOGITS = np.random.default_rng(0).standard_normal(1000) * 3


def draws(params: SamplingParams, n: int = 50) -> list[int]:
    s = Sampler(params)
    return [s(LOGITS) for _ in range(n)]


def test_temperature_zero_is_argmax():
    assert draws(SamplingParams(), 3) == [int(LOGITS.argmax())] * 3


def test_same_seed_draws_the_same_tokens_and_another_seed_does_not():
    p = SamplingParams(temperature=1.0, seed=11)
    assert draws(p) == draws(p)
    assert draws(p) != draws(SamplingParams(temperature=1.0, seed=12))


def test_top_k_limits_draws_to_the_k_best():
    best = set(np.argsort(-LOGITS)[:5].tolist())
    assert set(draws(SamplingParams(temperature=5.0, top_k=5, seed=1), 200)) <= best
    assert draws(SamplingParams(temperature=5.0, top_k=1, seed=1), 5) == [int(LOGITS.argmax())] * 5


def test_top_p_keeps_the_smallest_nucleus():
    z = np.array([5.0, 4.0, 0.0, -1.0])
    p = np.exp(z) / np.exp(z).sum()
    s = Sampler(SamplingParams(temperature=1.0, top_p=float(p[0] + p[1]) - 1e-6, seed=3))
    assert set(s(z) for _ in range(200)) == {0, 1}


def test_top_p_counts_the_probabilities_before_the_temperature():
    """As llama.cpp's chain: a hot temperature flattens what top-p kept, it does not widen
    the nucleus (at 5.0 the two best would hold < 60 % and top-p would keep more)."""
    z = np.array([5.0, 4.0, 0.0, -1.0])
    p = np.exp(z) / np.exp(z).sum()
    s = Sampler(SamplingParams(temperature=5.0, top_p=float(p[0] + p[1]) - 1e-6, seed=3))
    assert set(s(z) for _ in range(300)) == {0, 1}


def test_min_p_keeps_tokens_at_least_that_fraction_as_likely_as_the_best():
    z = np.log(np.array([0.5, 0.3, 0.1, 0.04, 0.03, 0.03]))
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.1, seed=5))
    assert set(s(z) for _ in range(400)) == {0, 1, 2}  # 0.04 < 0.1 x 0.5
    hot = Sampler(SamplingParams(temperature=2.0, min_p=0.1, seed=5))
    assert set(hot(z) for _ in range(400)) == {0, 1, 2}  # before the temperature
    assert Sampler(SamplingParams(temperature=1.0, min_p=1.0, seed=5))(z) == 0


def test_a_gguf_recommendation_replaces_llama_servers_defaults_where_it_is_sound():
    assert Recommended.of(lambda key: None) == LLAMA_SERVER == Recommended(0.8, 40, 0.95, 0.05)
    meta = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
            "general.sampling.top_p": 0.8, "general.sampling.min_p": 0.0}
    assert Recommended.of(meta.get) == Recommended(0.6, 20, 0.8, 0.0)
    wrong = {"general.sampling.temp": "hot", "general.sampling.top_k": 2.5,
             "general.sampling.top_p": 0.0, "general.sampling.min_p": float("nan")}
    assert Recommended.of(wrong.get) == LLAMA_SERVER


def test_repetition_penalty_moves_away_from_seen_tokens():
    z = np.array([2.0, 1.9, -1.0])
    s = Sampler(SamplingParams(repetition_penalty=1.5))
    assert s(z) == 0 and s(z, history=[0]) == 1
    assert Sampler(SamplingParams(repetition_penalty=1.5))(np.array([-1.0, -1.2]), [0]) == 1


def test_log_softmax_normalises():
    assert np.exp(log_softmax(LOGITS)).sum() == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=float("nan")),
                                 dict(top_k=-2), dict(top_p=0), dict(top_p=1.5),
                                 dict(min_p=-0.1), dict(min_p=1.5),
                                 dict(repetition_penalty=0), dict(seed=-1),
                                 dict(seed=1 << 64)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(InputError):
        SamplingParams(**bad)


@pytest.mark.parametrize("logits", [[1.0, np.nan], [np.nan, 1.0], [1.0, np.inf], [],
                                    [-np.inf, -np.inf]])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, seed=1),
                                    SamplingParams(repetition_penalty=1.2)])
def test_non_finite_logits_are_refused(logits, params):
    with pytest.raises(InputError, match="finite"):
        Sampler(params)(np.array(logits, np.float32))

"""Sampling: greedy, seeded determinism, the filters, and refusal of bad settings."""

from __future__ import annotations

import numpy as np
import pytest

from kvasird.compute.errors import InputError
from kvasird.compute.sampling import Sampler, SamplingParams, log_softmax

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


def test_repetition_penalty_moves_away_from_seen_tokens():
    z = np.array([2.0, 1.9, -1.0])
    s = Sampler(SamplingParams(repetition_penalty=1.5))
    assert s(z) == 0 and s(z, history=[0]) == 1
    assert Sampler(SamplingParams(repetition_penalty=1.5))(np.array([-1.0, -1.2]), [0]) == 1


def test_log_softmax_normalises():
    assert np.exp(log_softmax(LOGITS)).sum() == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=float("nan")),
                                 dict(top_k=-2), dict(top_p=0), dict(top_p=1.5),
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

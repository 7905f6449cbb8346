"""The numpy sampler: the recorded logprob is log softmax(logits / T) before any truncation."""

from __future__ import annotations

import numpy as np
import pytest

from tokentape.core.sampling import SamplingParams
from tokentape.engines.sampler import log_softmax, sample_token

LOGITS = np.array([2.0, 1.0, 0.5, -1.0, -3.0], dtype=np.float32)


def test_greedy_takes_the_argmax_and_records_the_temperature_one_logprob() -> None:
    token, logprob, _ = sample_token(LOGITS, SamplingParams(temperature=0.0), np.random.default_rng(0))
    assert token == 0
    assert logprob == pytest.approx(float(log_softmax(LOGITS.astype(np.float64))[0]))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(top_k=2),
        SamplingParams(min_p=0.2),
    ],
)
def test_logprob_is_untruncated_and_temperature_scaled(params: SamplingParams) -> None:
    rng = np.random.default_rng(1)
    expected = log_softmax(LOGITS.astype(np.float64) / params.temperature)
    for _ in range(50):
        token, logprob, _ = sample_token(LOGITS, params, rng)
        assert logprob == pytest.approx(float(expected[token]))


def test_top_p_top_k_and_min_p_restrict_the_candidates() -> None:
    rng = np.random.default_rng(2)
    drawn = {
        name: {sample_token(LOGITS, params, rng)[0] for _ in range(300)}
        for name, params in {
            "top_p": SamplingParams(top_p=0.7),
            "top_k": SamplingParams(top_k=2),
            "min_p": SamplingParams(min_p=0.2),
            "none": SamplingParams(),
        }.items()
    }
    assert drawn["top_p"] == {0, 1}  # p = .61, .22, .14, ...: two tokens reach .7
    assert drawn["top_k"] == {0, 1}
    assert drawn["min_p"] == {0, 1, 2}  # p >= .2 * .61
    assert drawn["none"] >= {0, 1, 2, 3}


# chi-square with 4 degrees of freedom (5 tokens): above this with probability 0.001
CHI2_4_AT_0_001 = 18.47


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_frequencies_follow_the_temperature(temperature: float) -> None:
    """The draws fit softmax(logits / T) and, by the same measure, do not fit a temperature 10% off:
    a sampler at the wrong temperature fails here."""
    draws = 20_000
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=temperature)
    counts = np.bincount([sample_token(LOGITS, params, rng)[0] for _ in range(draws)], minlength=5)

    def chi2(t: float) -> float:
        expected = np.exp(log_softmax(LOGITS.astype(np.float64) / t)) * draws
        return float(np.sum((counts - expected) ** 2 / expected))

    assert chi2(temperature) < CHI2_4_AT_0_001
    assert chi2(temperature * 1.1) > CHI2_4_AT_0_001
    assert chi2(temperature / 1.1) > CHI2_4_AT_0_001


def test_top_logprobs_are_the_best_tokens_in_order() -> None:
    _, _, top = sample_token(LOGITS, SamplingParams(logprobs=True, top_logprobs=3), np.random.default_rng(0))
    assert [t for t, _ in top] == [0, 1, 2]
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)

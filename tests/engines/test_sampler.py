"""The numpy sampler: the recorded logprob is log softmax(logits / T) before any truncation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentape.core.sampling import SamplingParams
from tokentape.engines import sampling_salt
from tokentape.engines.sampler import LogitShaper, SamplingError, log_softmax, sample_token
from tokentape.errors import InvalidRequest

# The sampler's own numerics, against formulas computed here: without the suite's sampling salt
# (its greedy jitter is tested on its own below).
pytestmark = pytest.mark.numerics

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


# -- every accepted value is safe ---------------------------------------------------------------------
# A row shaped like a real model's: 49,152 logits, a few far ahead of the rest.
WIDE = np.random.default_rng(7).normal(0.0, 3.0, 49_152).astype(np.float32)
WIDE[[11, 200, 3000]] = [18.0, 17.999, 12.0]


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, 1e-20, 9.99e-6, -0.0, 0.0])
def test_a_temperature_below_vllms_threshold_is_greedy(temperature: float) -> None:
    """Dividing by a subnormal temperature overflowed the logits to inf and NaN probabilities, which
    killed the worker: below 1e-5 (vLLM's threshold) a request is greedy, as vLLM makes it."""
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0
    token, logprob, _ = sample_token(WIDE, params, np.random.default_rng(0))
    assert token == 11
    assert logprob == pytest.approx(float(log_softmax(WIDE.astype(np.float64))[11]))


def test_the_smallest_sampling_temperature_stays_finite() -> None:
    params = SamplingParams(temperature=1e-5)
    token, logprob, _ = sample_token(WIDE, params, np.random.default_rng(0))
    assert token == 11 and np.isfinite(logprob)  # 0.001 / 1e-5 = 100 nats ahead of the runner-up
    assert logprob == pytest.approx(float(log_softmax(WIDE.astype(np.float64) / 1e-5)[11]))


EDGES: list[dict[str, float | int]] = [
    {"top_p": 5e-324},
    {"top_p": 1e-300, "top_k": 1},
    {"top_p": 0.9999999999999999},
    {"top_k": 1},
    {"top_k": 49_151},
    {"top_k": 49_152},
    {"top_k": 2**62},
    {"min_p": 1.0},
    {"min_p": 5e-324},
    {"min_p": 1.0, "top_p": 5e-324, "top_k": 1},
    {"temperature": 2.0, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 1e-5, "min_p": 1.0},
]


@pytest.mark.parametrize("settings", EDGES)
def test_every_edge_of_the_cuts_draws_a_kept_token_with_a_finite_logprob(settings: dict[str, float | int]) -> None:
    params = SamplingParams(**settings)  # type: ignore[arg-type]
    rng = np.random.default_rng(5)
    expected = log_softmax(WIDE.astype(np.float64) / params.temperature)
    for _ in range(20):
        token, logprob, _ = sample_token(WIDE, params, rng)
        assert 0 <= token < WIDE.size and np.isfinite(logprob)
        assert logprob == pytest.approx(float(expected[token]))
        if params.top_k == 1 or params.min_p == 1.0 or params.top_p < 1e-200:
            assert token == 11  # only the best token survives these cuts


def test_nan_and_infinite_logits_are_sampled_around_or_refused_for_their_generation() -> None:
    rng = np.random.default_rng(0)
    row = WIDE.copy()
    row[[5, 6]] = np.nan
    for _ in range(50):
        assert sample_token(row, SamplingParams(), rng)[0] not in (5, 6)
    row[7] = np.inf  # a certain token: it takes all the mass
    assert sample_token(row, SamplingParams(temperature=0.7), rng)[:2] == (7, 0.0)
    hopeless = np.full(8, -np.inf, dtype=np.float32)
    hopeless[2] = np.nan
    with pytest.raises(SamplingError):
        sample_token(hopeless, SamplingParams(), rng)


# -- the logit bias and the penalties: vLLM's formulas, computed here independently -------------------
def test_logit_bias_reshapes_the_distribution_sampled_and_recorded() -> None:
    params = SamplingParams(temperature=0.8, logit_bias=((3, 4.0), (0, -100.0)))
    shaper = LogitShaper(params, [], LOGITS.size)
    biased = LOGITS.astype(np.float64) + np.array([-100.0, 0, 0, 4.0, 0])
    expected = log_softmax(biased / 0.8)
    rng = np.random.default_rng(11)
    draws = [sample_token(LOGITS, params, rng, shaper) for _ in range(20_000)]
    for token, logprob, _ in draws[:50]:
        assert logprob == pytest.approx(float(expected[token]))
    counts = np.bincount([t for t, _, _ in draws], minlength=5)
    assert counts[0] == 0
    observed = counts / counts.sum()
    assert observed == pytest.approx(np.exp(expected), abs=0.015)


def test_penalties_follow_what_the_choice_has_sampled() -> None:
    prompt = [1, 1, 4]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.5, temperature=1.0)
    shaper = LogitShaper(params, prompt, LOGITS.size)
    rng = np.random.default_rng(3)
    sampled: list[int] = []
    for _ in range(30):
        logits = LOGITS.astype(np.float64)
        seen = set(prompt) | set(sampled)
        counts = np.bincount(sampled, minlength=5) if sampled else np.zeros(5)
        for t in seen:  # vLLM's repetition penalty: over prompt and output, by the logit's sign
            logits[t] = logits[t] / 1.5 if logits[t] > 0 else logits[t] * 1.5
        logits = logits - 0.3 * counts - 0.5 * (counts > 0)
        expected = log_softmax(logits)
        token, logprob, _ = sample_token(LOGITS, params, rng, shaper)
        assert logprob == pytest.approx(float(expected[token]))
        shaper.accept(token)
        sampled.append(token)
    assert len(set(sampled)) >= 3  # the penalties spread the draws


def test_the_shaper_is_made_only_when_something_reshapes() -> None:
    assert not LogitShaper.needed(SamplingParams(temperature=0.3, top_k=4))
    assert LogitShaper.needed(SamplingParams(presence_penalty=-2.0))
    assert LogitShaper.needed(SamplingParams(repetition_penalty=0.5))
    assert LogitShaper.needed(SamplingParams(logit_bias=((1, 0.5),)))


@pytest.mark.parametrize(
    ("settings", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"logit_bias": ((1, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(1025))}, "logit_bias"),
        ({"temperature": -1e-300}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
    ],
)
def test_out_of_range_settings_are_refused_naming_the_field(settings: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        SamplingParams(**settings)  # type: ignore[arg-type]
    assert refused.value.param == param


# -- fuzzed: any accepted combination, any row ------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    temperature=st.one_of(st.just(0.0), st.floats(0.0, 2.0, allow_subnormal=True)),
    top_p=st.floats(5e-324, 1.0, allow_subnormal=True),
    top_k=st.one_of(st.just(0), st.integers(1, 2**63 - 1)),
    min_p=st.floats(0.0, 1.0, allow_subnormal=True),
    presence=st.floats(-2.0, 2.0),
    frequency=st.floats(-2.0, 2.0),
    repetition=st.floats(5e-324, 2.0, allow_subnormal=True),
    bias=st.lists(st.tuples(st.integers(0, 63), st.floats(-100.0, 100.0)), max_size=8, unique_by=lambda p: p[0]),
    row=st.lists(
        st.one_of(
            st.floats(width=32, allow_nan=False, allow_infinity=False), st.sampled_from([np.inf, -np.inf, np.nan])
        ),
        min_size=64,
        max_size=64,
    ),
    history=st.lists(st.integers(0, 63), max_size=8),
)
def test_no_accepted_setting_and_no_row_breaks_the_sampler(
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    presence: float,
    frequency: float,
    repetition: float,
    bias: list[tuple[int, float]],
    row: list[float],
    history: list[int],
) -> None:
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=tuple(sorted(bias)),
        logprobs=True,
        top_logprobs=5,
    )
    shaper = LogitShaper(params, history, 64)
    for token in history:
        shaper.accept(token)
    logits = np.array(row, dtype=np.float32)
    try:
        token, logprob, top = sample_token(logits, params, np.random.default_rng(0), shaper)
    except SamplingError:
        shaped = shaper.apply(np.where(np.isnan(logits), -np.inf, logits.astype(np.float64)))
        assert not np.isfinite(shaped).any() and not np.isposinf(shaped).any()  # nothing was left to draw
        return
    assert 0 <= token < 64
    assert not np.isnan(logprob) and logprob <= 0.0
    assert logits[token] == logits[token] or np.isposinf(logits).any()  # never a NaN logit's token
    assert len(top) == 5


# -- the suite's sampling salt ----------------------------------------------------------------------------
def test_under_a_salt_greedy_argmaxes_the_jittered_row_and_records_its_logprob(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy decoding moves with the salt wherever two tokens are within the jitter, and the logprob
    recorded is the one of the row the token was chosen from."""
    row = np.array([3.0, 3.0 + 1e-4, 3.0 - 1e-4, -2.0], dtype=np.float32)
    chosen = set()
    for salt in range(12):
        monkeypatch.setenv(sampling_salt.SALT_ENV, str(salt))
        jitter = np.random.default_rng(salt).uniform(-sampling_salt.DEFAULT_JITTER, sampling_salt.DEFAULT_JITTER, 4)
        jittered = row.astype(np.float64) + jitter
        token, logprob, _ = sample_token(row, SamplingParams(temperature=0.0), np.random.default_rng(0))
        assert token == int(np.argmax(jittered))
        assert logprob == pytest.approx(float(log_softmax(jittered)[token]))
        chosen.add(token)
        again = sample_token(row, SamplingParams(temperature=0.0), np.random.default_rng(1))
        assert again[:2] == (token, logprob)  # within a run the engine is self-consistent
    assert len(chosen) >= 2
    assert row[3] < row[:3].min() and 3 not in chosen  # far behind: never chosen


def test_a_salt_changes_seeded_streams_between_runs_and_keeps_them_within_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sampling_salt.SALT_ENV, "1")
    first = sampling_salt.salted_seed(42)
    assert first == sampling_salt.salted_seed(42) and first != sampling_salt.salted_seed(43)
    monkeypatch.setenv(sampling_salt.SALT_ENV, "2")
    assert sampling_salt.salted_seed(42) != first
    assert sampling_salt.salted_seed(None) is None
    monkeypatch.delenv(sampling_salt.SALT_ENV)
    assert sampling_salt.salted_seed(42) == 42 and sampling_salt.greedy_jitter(10) is None


def _reference(logits: np.ndarray, params: SamplingParams, uniform: float) -> tuple[int, float, list[int]]:
    """The sampler written plainly: a stable sort of the whole row for every cut, one cumulative sum."""
    raw = logits.astype(np.float64)
    x = raw if params.temperature == 0.0 else raw / params.temperature
    shifted = x - np.max(x)
    logp = shifted - np.log(np.sum(np.exp(shifted)))
    order = np.argsort(-logp, kind="stable")
    best = [int(t) for t in order[: params.top_logprobs]]
    if params.temperature == 0.0:
        token = int(np.argmax(logp))
        return token, float(logp[token]), best
    probs = np.exp(logp)
    keep = probs > 0.0
    by_prob = np.argsort(-probs, kind="stable")
    if params.top_k and params.top_k < probs.size:
        keep &= probs >= probs[by_prob[params.top_k - 1]]
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    if params.top_p < 1.0:
        last = int(np.searchsorted(np.cumsum(probs[by_prob]), params.top_p, side="left"))
        nucleus = np.zeros(probs.size, dtype=bool)
        nucleus[by_prob[: last + 1]] = True
        keep &= nucleus
    cdf = np.cumsum(np.where(keep, probs, 0.0))
    token = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    return token, float(logp[token]), best


@pytest.mark.parametrize("vocab", [7, 600, 49_152])
def test_the_sampler_draws_what_a_plain_full_sort_would(vocab: int) -> None:
    """Scratch buffers, the sorted candidates of the cuts and the blocked draw are speed only: the
    same token, logprob and alternatives as the plain formulas, draw for draw, on peaked and flat
    rows with ties (logits rounded to halves), under every cut and their mixes."""
    rng = np.random.default_rng(vocab)
    settings = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.3, "top_p": 0.5, "top_k": 50},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 1.0, "top_p": 0.999},
        {"temperature": 0.0},
    ]
    draws = 0
    for row in range(24):
        scale = [0.5, 3.0, 12.0][row % 3]  # flat, usual, peaked
        logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
        if row % 2:
            logits = np.round(logits * 2) / 2  # ties
        for fields in settings:
            params = SamplingParams(**fields, logprobs=True, top_logprobs=5)  # type: ignore[arg-type]
            seed = int(rng.integers(2**32))
            token, logprob, top = sample_token(logits, params, np.random.default_rng(seed))
            expected = _reference(logits, params, np.random.default_rng(seed).random())
            assert (token, logprob, [t for t, _ in top]) == expected, (vocab, row, fields)
            draws += 1
    assert draws == 24 * len(settings)

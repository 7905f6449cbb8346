"""Token sampling from one row of logits, in numpy, so the recorded logprob is exactly the
distribution the token was drawn from before truncation (shaped logits / temperature).

Every setting a request may carry is safe over its whole accepted range: the softmax is taken in log
space in float64, a temperature below `GREEDY_BELOW` arrives as 0 (greedy), the draw is an inverse
CDF over finite weights (no validation that a rounding error could fail), and a row with no finite
logit is an error for its own generation (`SamplingError`), never for the worker."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from tokentape.core.sampling import SamplingParams
from tokentape.engines import sampling_salt

__all__ = ["LogitShaper", "SamplingError", "sample_token", "log_softmax"]

Floats = npt.NDArray[np.float64]


class SamplingError(ValueError):
    """The logits leave nothing to sample (every one -inf or NaN): the generation cannot go on."""


def log_softmax(x: Floats) -> Floats:
    shifted = x - np.max(x)
    result: Floats = shifted - np.log(np.sum(np.exp(shifted)))
    return result


class LogitShaper:
    """What a request does to the logits before the temperature, in vLLM's order: the logit bias (and
    banned tokens), then the repetition, frequency and presence penalties over what this choice has
    seen. Its counts follow the choice token by token (`accept`)."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab_size: int) -> None:
        self.params = params
        self._bias: Floats | None = None
        if params.logit_bias or params.banned_token_ids:
            bias = np.zeros(vocab_size, dtype=np.float64)
            for token, value in params.logit_bias:
                if token < vocab_size:  # the gateway refuses the others; an engine never indexes past its vocabulary
                    bias[token] = value
            banned = [t for t in params.banned_token_ids if 0 <= t < vocab_size]
            bias[banned] = -np.inf
            self._bias = bias
        counting = bool(params.frequency_penalty or params.presence_penalty)
        self._counts = np.zeros(vocab_size, dtype=np.int64) if counting else None
        self._seen: npt.NDArray[np.bool_] | None = None
        if params.repetition_penalty != 1.0:
            self._seen = np.zeros(vocab_size, dtype=bool)
            in_vocab = np.asarray(prompt, dtype=np.int64)
            self._seen[in_vocab[(in_vocab >= 0) & (in_vocab < vocab_size)]] = True

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        return params.reshapes_logits or bool(params.banned_token_ids)

    def apply(self, logits: Floats) -> Floats:
        params = self.params
        shaped = logits if self._bias is None else logits + self._bias
        if self._seen is not None:
            penalty = params.repetition_penalty
            scaled = np.where(shaped > 0, shaped / penalty, shaped * penalty)
            shaped = np.where(self._seen, scaled, shaped)
        if self._counts is not None:
            shaped = shaped - params.frequency_penalty * self._counts - params.presence_penalty * (self._counts > 0)
        return shaped

    def accept(self, token: int) -> None:
        if self._counts is not None and 0 <= token < self._counts.size:
            self._counts[token] += 1
        if self._seen is not None and 0 <= token < self._seen.size:
            self._seen[token] = True


def sample_token(
    logits: npt.NDArray[np.float32],
    params: SamplingParams,
    rng: np.random.Generator,
    shaper: LogitShaper | None = None,
) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """Draw one token. Returns (token, its logprob, the top `params.top_logprobs` alternatives).

    Temperature 0 is greedy and records the logprob at temperature 1 (of the shaped logits). Under the
    suite's sampling salt (`sampling_salt`) greedy decoding argmaxes over logits plus that run's jitter,
    and records the logprob of the same jittered row."""
    raw = logits.astype(np.float64)
    raw[np.isnan(raw)] = -np.inf  # a NaN logit can never be drawn; +inf stays the certain token
    if shaper is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            raw = shaper.apply(raw)
        raw[np.isnan(raw)] = -np.inf  # a banned token whose logit was +inf
    if np.isposinf(raw).any():
        raw = np.where(np.isposinf(raw), 0.0, -np.inf)  # the infinite ones share all the mass
    elif not np.isfinite(raw).any():
        raise SamplingError("the logits leave no token to sample (all -inf or NaN)")
    greedy = params.temperature == 0.0
    if greedy:
        jitter = sampling_salt.greedy_jitter(raw.size)
        if jitter is not None:
            raw = raw + jitter
    logp = log_softmax(raw if greedy else raw / params.temperature)
    token = int(np.argmax(logp)) if greedy else _draw(logp, params, rng)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        k = min(params.top_logprobs, logp.size)
        best = np.argpartition(-logp, k - 1)[:k]
        best = best[np.argsort(-logp[best], kind="stable")]
        top = tuple((int(t), float(logp[t])) for t in best)
    return token, float(logp[token]), top


def _draw(logp: Floats, params: SamplingParams, rng: np.random.Generator) -> int:
    probs = np.exp(logp)  # the best token has probability exp(0 - log Z) > 0: never all zero
    keep = probs > 0.0
    if params.top_k and params.top_k < probs.size:
        cutoff = np.partition(probs, probs.size - params.top_k)[probs.size - params.top_k]
        keep &= probs >= cutoff
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        last = int(np.searchsorted(cumulative, params.top_p, side="left"))
        nucleus = np.zeros_like(keep)
        nucleus[order[: last + 1]] = True
        keep &= nucleus
    weights = np.where(keep, probs, 0.0)
    return _inverse_cdf(weights, rng.random())


_BLOCK = 512  # the draw finds a block of this many tokens by their sums, then the token inside it


def _inverse_cdf(weights: Floats, uniform: float) -> int:
    """The first token whose cumulative weight passes `uniform` x the total (a token with weight > 0).
    A cumulative sum over the whole row is sequential (0.4 ms for 49k tokens, a third of a sampled
    token's cost); over the blocks' sums and then one block it is two short ones."""
    size = weights.size
    if size <= _BLOCK:
        return _first_past(weights, uniform * float(np.sum(weights)))
    padded = np.zeros(-(-size // _BLOCK) * _BLOCK)
    padded[:size] = weights
    blocks = padded.reshape(-1, _BLOCK)
    ends = np.cumsum(blocks.sum(axis=1))
    point = uniform * float(ends[-1])
    block = min(int(np.searchsorted(ends, point, side="right")), ends.size - 1)
    while block > 0 and ends[block] == ends[block - 1]:  # rounding landed past the weight: step back to it
        block -= 1
    start = float(ends[block - 1]) if block else 0.0
    return block * _BLOCK + _first_past(blocks[block], point - start)


def _first_past(weights: Floats, point: float) -> int:
    """The first index whose cumulative weight passes `point`, or, where rounding put the point at or
    past the end, the last index with weight."""
    cdf = np.cumsum(weights)
    index = int(np.searchsorted(cdf, point, side="right"))
    return index if index < weights.size else int(np.flatnonzero(weights)[-1])

"""Token sampling from one row of logits, in numpy, so the recorded logprob is exactly the
distribution the token was drawn from before truncation (shaped logits / temperature).

Every setting a request may carry is safe over its whole accepted range: the softmax is taken in log
space in float64, a temperature below `GREEDY_BELOW` arrives as 0 (greedy), the draw is an inverse
CDF over finite weights (no validation that a rounding error could fail), and a row with no finite
logit is an error for its own generation (`SamplingError`), never for the worker."""

from __future__ import annotations

import threading
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
    result: Floats = np.array(x, dtype=np.float64)
    _log_softmax_in_place(result, np.empty_like(result))
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
    and records the logprob of the same jittered row.

    The row's float64 copies live in this thread's scratch buffers: a fresh array of a 49k vocabulary
    is 393 KB, past the allocator's mmap threshold, and its page faults cost ten times the exp."""
    scratch = _scratch(logits.size)
    raw = scratch.raw
    np.copyto(raw, logits)
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
    logp = scratch.logp
    if greedy or params.temperature == 1.0:
        np.copyto(logp, raw)
    else:
        np.divide(raw, params.temperature, out=logp)
    _log_softmax_in_place(logp, scratch.probs)
    token = int(np.argmax(logp)) if greedy else _draw(logp, params, rng, scratch)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        k = min(params.top_logprobs, logp.size)
        best = _largest(logp, k)
        top = tuple((int(t), float(logp[t])) for t in best)
    return token, float(logp[token]), top


class _Scratch:
    """One thread's float64 rows for one vocabulary size; `weights` is padded to whole blocks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.raw = np.empty(size)
        self.logp = np.empty(size)
        self.probs = np.empty(size)
        self.weights = np.zeros(-(-size // _BLOCK) * _BLOCK)


_local = threading.local()


def _scratch(size: int) -> _Scratch:
    scratch: _Scratch | None = getattr(_local, "scratch", None)
    if scratch is None or scratch.size != size:
        scratch = _local.scratch = _Scratch(size)
    return scratch


def _log_softmax_in_place(x: Floats, exps: Floats) -> None:
    """`x` becomes log softmax(x) (shifted by its max, in log space), with `exps` as its scratch."""
    np.subtract(x, np.max(x), out=x)
    np.exp(x, out=exps)
    np.subtract(x, np.log(np.sum(exps)), out=x)


def _largest(values: Floats, k: int) -> npt.NDArray[np.intp]:
    """The indices of the `k` largest values, best first, ties in index order (as a stable sort of
    the whole row by descending value would list them)."""
    candidates = _at_least(values, k)
    result: npt.NDArray[np.intp] = candidates[np.argsort(-values[candidates], kind="stable")[:k]]
    return result


_STRIDE = 64  # every 64th value is a sample of the row, to guess a threshold from


def _at_least(values: Floats, k: int) -> npt.NDArray[np.intp]:
    """Ascending indices of every value at or above a threshold that at least `k` values reach: so
    the k largest and every tie of the k-th are among them. The threshold is the k-th largest of
    every 64th value, and a row of 49k is compared instead of partitioned (0.3 ms)."""
    if k * _STRIDE >= values.size:
        return np.arange(values.size)
    sample = values[::_STRIDE]
    threshold = np.partition(sample, sample.size - k)[sample.size - k]
    return np.flatnonzero(values >= threshold)


def _draw(logp: Floats, params: SamplingParams, rng: np.random.Generator, scratch: _Scratch) -> int:
    probs = scratch.probs
    np.exp(logp, out=probs)  # the best token has probability exp(0 - log Z) > 0: never all zero
    keep = probs > 0.0
    if params.top_k and params.top_k < probs.size:
        keep &= probs >= probs[_largest(probs, params.top_k)[-1]]
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    if params.top_p < 1.0:
        keep &= _nucleus(probs, params.top_p)
    weights = scratch.weights  # its padding past the row stays 0
    row = weights[: probs.size]
    row.fill(0.0)
    np.copyto(row, probs, where=keep)
    return _inverse_cdf(weights, probs.size, rng.random())


def _nucleus(probs: Floats, top_p: float) -> npt.NDArray[np.bool_]:
    """The smallest set of most probable tokens whose mass reaches `top_p` (at least the best one),
    ties in index order: the prefix a stable sort of the whole row would give, found by sorting only
    the most probable tokens (more of them until their mass reaches `top_p`) instead of all 49k
    (4.7 ms)."""
    count = 64
    while True:
        candidates = _at_least(probs, count)
        order = candidates[np.argsort(-probs[candidates], kind="stable")]
        cumulative = np.cumsum(probs[order])
        if cumulative[-1] >= top_p or candidates.size == probs.size:
            break
        count *= 8
    # keep the smallest prefix whose mass reaches top_p (always at least the best token)
    last = int(np.searchsorted(cumulative, top_p, side="left"))
    nucleus = np.zeros(probs.size, dtype=bool)
    nucleus[order[: last + 1]] = True
    return nucleus


_BLOCK = 512  # the draw finds a block of this many tokens by their sums, then the token inside it


def _inverse_cdf(padded: Floats, size: int, uniform: float) -> int:
    """The first token whose cumulative weight passes `uniform` x the total (a token with weight > 0),
    over `padded`: the row's `size` weights, then zeros to a whole number of blocks. A cumulative sum
    over the whole row is sequential (0.4 ms for 49k tokens, a third of a sampled token's cost); over
    the blocks' sums and then one block it is two short ones."""
    if size <= _BLOCK:
        weights = padded[:size]
        return _first_past(weights, uniform * float(np.sum(weights)))
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

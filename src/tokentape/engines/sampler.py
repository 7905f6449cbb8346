"""Token sampling from one row of logits, in numpy, so the recorded logprob is exactly the
distribution the token was drawn from before truncation (logits / temperature)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tokentape.core.sampling import SamplingParams

__all__ = ["sample_token", "log_softmax"]


def log_softmax(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    shifted = x - np.max(x)
    result: npt.NDArray[np.float64] = shifted - np.log(np.sum(np.exp(shifted)))
    return result


def sample_token(
    logits: npt.NDArray[np.float32], params: SamplingParams, rng: np.random.Generator
) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """Draw one token. Returns (token, its logprob, the top `params.top_logprobs` alternatives).

    Temperature 0 is greedy and records the logprob at temperature 1.
    """
    raw = logits.astype(np.float64)
    greedy = params.temperature == 0.0
    logp = log_softmax(raw if greedy else raw / params.temperature)
    token = int(np.argmax(logp)) if greedy else _draw(logp, params, rng)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        k = params.top_logprobs
        best = np.argpartition(-logp, k - 1)[:k]
        best = best[np.argsort(-logp[best], kind="stable")]
        top = tuple((int(t), float(logp[t])) for t in best)
    return token, float(logp[token]), top


def _draw(logp: npt.NDArray[np.float64], params: SamplingParams, rng: np.random.Generator) -> int:
    probs = np.exp(logp)
    keep = np.ones_like(probs, dtype=bool)
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
    weights /= weights.sum()
    return int(rng.choice(weights.size, p=weights))

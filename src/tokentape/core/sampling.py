"""Sampling parameters after the wire layer parsed their types: ranges, defaults, named limits."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokentape.errors import InvalidRequest

__all__ = ["SamplingParams", "MAX_CHOICES", "MAX_STOP_SEQUENCES", "MAX_TOP_LOGPROBS", "MAX_SEED"]

MAX_CHOICES = 16  # n > 16 multiplies one request into minutes of CPU generation
MAX_STOP_SEQUENCES = 4  # OpenAI's own limit
MAX_TOP_LOGPROBS = 20  # OpenAI's own limit
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What an engine needs to sample one choice, plus what the gateway needs to finish it."""

    max_tokens: int | None = None  # None: until a stop or the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    # tokens the engine must not sample (a vision model's image placeholders): logit bias -100
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequest("top_p must be greater than 0", param="top_p")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.top_k < 0:
            raise InvalidRequest("top_k must be 0 (off) or positive", param="top_k")
        if self.seed is not None and not -MAX_SEED - 1 <= self.seed <= MAX_SEED:
            raise InvalidRequest("seed must fit in a signed 64-bit integer", param="seed")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidRequest(f"at most {MAX_STOP_SEQUENCES} stop sequences", param="stop")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("stop sequences must not be empty", param="stop")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs", param="top_logprobs")
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}", param="n")

    def distribution(self) -> dict[str, float]:
        """The settings that shape the distribution a token is sampled from (what a trainer's logprobs
        must be computed under), as recorded on each turn."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}

    def choice_seed(self, index: int) -> int | None:
        """Each of n choices gets its own stream, still reproducible from one seed."""
        return None if self.seed is None else (self.seed + index) % (2**64)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low:g} and {high:g}", param=name)

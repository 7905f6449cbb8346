"""Sampling parameters after the wire layer parsed their types: ranges, defaults, named limits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokentape.errors import InvalidRequest

__all__ = [
    "SamplingParams",
    "GREEDY_BELOW",
    "MAX_CHOICES",
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_PENALTY",
    "MAX_REPETITION_PENALTY",
    "MAX_STOP_LENGTH",
    "MAX_STOP_SEQUENCES",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOP_LOGPROBS",
    "MAX_SEED",
    "TOP_K_OFF",
    "request_top_k",
]

MAX_CHOICES = 16  # n > 16 multiplies one request into minutes of CPU generation
MAX_STOP_SEQUENCES = 4  # OpenAI's own limit
# Text that could still become a stop string is held back and rescanned with each token: a stop string
# of megabytes would cost the event loop seconds a token. Real stop strings are words and tags.
MAX_STOP_LENGTH = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's own limit
MAX_SEED = 2**63 - 1
# vLLM's threshold (_SAMPLING_EPS): a temperature below it is greedy. Dividing logits by a subnormal
# temperature overflows them to infinity, so every engine gets 0 instead.
GREEDY_BELOW = 1e-5
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_REPETITION_PENALTY = 2.0  # vLLM's repetition_penalty: (0, 2] here; 1 is off
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
# top_k has one convention inside the gateway: an int, TOP_K_OFF (0) for no cut; a turn records it so.
# It is converted at the edges only: a request's top_k by `request_top_k` (-1, 0 and no value are all
# off, as in vLLM); an engine's by its adapter: -1 for off on vLLM's and SGLang's wire and in vLLM's
# own SamplingParams under OpenRLHF (`engines.remote.wire.engine_top_k`), 0 in the embedded sampler.
# A top_k at or past the size of the vocabulary cuts nothing.
TOP_K_OFF = 0
MAX_STOP_TOKEN_IDS = 1024  # more than any vocabulary's end-of-turn tokens; bounds what one request holds


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What an engine needs to sample one choice, plus what the gateway needs to finish it."""

    max_tokens: int | None = None  # None: until a stop or the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_OFF  # TOP_K_OFF (0): no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    # tokens the engine must not sample (a vision model's image placeholders): logit bias -100
    banned_token_ids: tuple[int, ...] = ()
    # What reshapes the logits before the temperature, in vLLM's order: the bias, then the penalties.
    # Each changes the distribution a trainer must recompute, so each is recorded with the turn.
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) sorted by token
    presence_penalty: float = 0.0  # minus this from every token already sampled in this choice
    frequency_penalty: float = 0.0  # minus this times how often it was sampled in this choice
    repetition_penalty: float = 1.0  # vLLM's: positive logits / it, negative * it, over prompt and output

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        _check_range("temperature", self.temperature, 0.0, 2.0)
        if self.temperature < GREEDY_BELOW:  # -0.0 and subnormals included: greedy, as vLLM takes them
            object.__setattr__(self, "temperature", 0.0)
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
        if any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise InvalidRequest(f"stop sequences may be at most {MAX_STOP_LENGTH} characters long", param="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs", param="top_logprobs")
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}", param="n")
        _check_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
        if self.repetition_penalty == 0.0:
            raise InvalidRequest("repetition_penalty must be greater than 0", param="repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequest(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens", param="logit_bias")
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidRequest(f"logit_bias names token {token}, which is not a token ID", param="logit_bias")
            _check_range("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

    @property
    def reshapes_logits(self) -> bool:
        """Whether a bias or a penalty changes the logits before the temperature."""
        return (
            bool(self.logit_bias)
            or bool(self.presence_penalty or self.frequency_penalty)
            or (self.repetition_penalty != 1.0)
        )

    def reshaping(self) -> dict[str, Any]:
        """The bias and penalties that are set, under vLLM's (and OpenAI's) names: what a remote
        engine is sent besides the temperature and the cuts (`logit_bias` keyed by token ID text)."""
        fields: dict[str, Any] = {}
        if self.logit_bias:
            fields["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        if self.presence_penalty:
            fields["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty:
            fields["frequency_penalty"] = self.frequency_penalty
        if self.repetition_penalty != 1.0:
            fields["repetition_penalty"] = self.repetition_penalty
        return fields

    def token_ids_outside(self, vocab_size: int) -> tuple[str, int] | None:
        """The first token ID this request names (a stop token, a biased token) that is not in a
        vocabulary of `vocab_size`, with the field naming it; None if all are."""
        for token in self.stop_token_ids:
            if not 0 <= token < vocab_size:
                return "stop_token_ids", token
        for token, _ in self.logit_bias:
            if not 0 <= token < vocab_size:
                return "logit_bias", token
        return None

    def distribution(self) -> dict[str, Any]:
        """The settings that shape the distribution a token is sampled from (what a trainer's logprobs
        must be computed under), as recorded on each turn. The bias and the penalties appear only when
        set, so a turn that recorded none reads as before."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            **self.reshaping(),
        }

    def choice_seed(self, index: int) -> int | None:
        """Each of n choices gets its own stream, still reproducible from one seed."""
        return None if self.seed is None else (self.seed + index) % (2**64)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low:g} and {high:g}", param=name)


def request_top_k(value: int | None) -> int:
    """A request's `top_k` in the gateway's convention: -1 (vLLM's off), 0 and no value are
    `TOP_K_OFF`; below -1 is refused, as vLLM refuses it."""
    if value is None or value == -1:
        return TOP_K_OFF
    if value < -1:
        raise InvalidRequest(f"top_k must be -1 or 0 (off) or positive, got {value}", param="top_k")
    return value

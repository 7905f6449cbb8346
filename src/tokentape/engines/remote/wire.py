"""What vLLM's and SGLang's wire formats share: the sampling fields they name alike, prompt IDs as
orjson writes them fastest, and the checks on what an engine sends back (a JSON object, a token of
this model, a logprob). Pure functions; a check that fails raises `EngineProtocolError`."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any

import numpy
import orjson

from tokentape.core.sampling import TOP_K_OFF, SamplingParams
from tokentape.core.token_ids import FirstPromptIds, PromptIds
from tokentape.errors import EngineProtocolError

__all__ = [
    "best_first",
    "engine_top_k",
    "json_object",
    "listed",
    "logprob",
    "logprob_list",
    "quote",
    "sampling_fields",
    "token_id",
    "token_ids",
    "token_text_id",
    "wire_ids",
]

BANNED = -100.0  # the logit bias that keeps a token from being sampled
LOGPROB_SLACK = 1e-3  # a logprob above 0 by more than rounding is not a log-probability
QUOTED = 200  # characters of an engine's answer quoted in an error


def quote(raw: object) -> str:
    text = raw if isinstance(raw, str) else repr(raw)
    return text if len(text) <= QUOTED else text[:QUOTED] + "..."


def json_object(raw: str | bytes) -> dict[str, Any]:
    try:
        event = orjson.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        event = None
    if not isinstance(event, dict):
        raise EngineProtocolError(f"the engine sent a line that is not a JSON object: {quote(raw)}")
    return event


def listed(value: object, name: str) -> list[Any]:
    """`value` if it is a list (None: an empty one)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise EngineProtocolError(f"the engine sent {name} that is not a list: {quote(value)}")
    return value


def token_id(value: object, vocab_size: int | None, what: str = "token id") -> int:
    if type(value) is not int or value < 0 or (vocab_size is not None and value >= vocab_size):
        raise EngineProtocolError(f"the engine sent {what} {quote(value)}, not a token of this model")
    return value


def token_ids(values: list[Any], vocab_size: int | None) -> list[int]:
    """`values` if every one is a token of this model (one loop, no call per token)."""
    vocab = vocab_size if vocab_size is not None else 1 << 62
    for value in values:
        if type(value) is not int or not 0 <= value < vocab:
            token_id(value, vocab_size)  # raises, naming the value
    return values


def logprob(value: object) -> float:
    number = float(value) if type(value) in (int, float) else math.nan  # type: ignore[arg-type]  # bool is no number
    if not math.isfinite(number) or number > LOGPROB_SLACK:
        raise EngineProtocolError(
            f"the engine sent logprob {quote(value)}; logprobs are finite numbers <= 0 "
            "(an engine reporting logits instead of logprobs is not supported)"
        )
    return min(number, 0.0)


def logprob_list(values: list[Any]) -> list[float]:
    """`logprob` of each value, with the common case (a float in range) checked inline."""
    out: list[float] = []
    for value in values:
        if type(value) is float and -math.inf < value <= 0.0:
            out.append(value)
        else:
            out.append(logprob(value))
    return out


def token_text_id(token: object) -> int:
    """`token_id:N`, as vLLM spells tokens with `return_tokens_as_token_ids`."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    raise EngineProtocolError(
        f"the engine named a token {quote(token)}, not `token_id:N` (is return_tokens_as_token_ids honoured?)"
    )


def best_first(alternatives: list[tuple[int, float]], keep: int) -> tuple[tuple[int, float], ...]:
    """The `keep` most likely alternatives, best first (vLLM lists the sampled token first, whatever its rank)."""
    alternatives.sort(key=lambda pair: -pair[1])
    return tuple(alternatives[:keep])


def wire_ids(tokens: Sequence[int], *, to_engine: bool = False) -> Any:
    """Prompt token IDs as orjson writes them fastest: a prompt planned on the tape carries its JSON
    text, written once for the engine and the response (and, for an engine, kept by the session for
    its next prompt: `PromptIds.json`); another int32 array, seen as numpy, is written in C without
    one Python int per token (0.27 against 3.4 ms at 128k)."""
    if isinstance(tokens, PromptIds | FirstPromptIds):
        return tokens.json(keep=to_engine)
    if isinstance(tokens, array) and tokens.itemsize == 4 and tokens.typecode in "il":
        return numpy.frombuffer(tokens, dtype=numpy.int32)
    return list(tokens)


def engine_top_k(top_k: int) -> int:
    """`SamplingParams.top_k` as vLLM and SGLang take it: -1 for no cut (`TOP_K_OFF`), the one value
    every version of both reads as off; a cut as it is, one past the vocabulary too (each engine keeps
    every token then, as the embedded sampler does)."""
    return -1 if top_k == TOP_K_OFF else top_k


def sampling_fields(prompt: Sequence[int], params: SamplingParams, context: int, *, length_key: str) -> dict[str, Any]:
    """The sampling fields vLLM and SGLang name alike; each adapter adds its own dialect's."""
    room = context - len(prompt)
    fields: dict[str, Any] = {
        length_key: room if params.max_tokens is None else min(params.max_tokens, room),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": engine_top_k(params.top_k),
        "min_p": params.min_p,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,  # stop tokens were sampled: their text stays
    }
    fields.update(params.reshaping())  # the request's bias and penalties, under the names both take
    if params.banned_token_ids:  # OpenAI's logit_bias, as both take it: -100 bans a token
        banned = {str(token): BANNED for token in params.banned_token_ids}
        fields["logit_bias"] = {**fields.get("logit_bias", {}), **banned}
    return fields

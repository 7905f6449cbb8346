"""vLLM's token route (`POST /inference/v1/generate`): token IDs in, token IDs and logprobs out.

The request is vLLM's `GenerateRequest` (`token_ids`, `sampling_params`, `model`, `stream`,
`request_id`); the answer its `GenerateResponse`: `choices[i] = {index, token_ids, finish_reason,
logprobs: {content: [{token: "token_id:N", logprob, bytes, top_logprobs}]}}` (vLLM always spells
tokens by ID on this route; `logprobs` is present when `sampling_params.logprobs` is set), plus
`prompt_token_ids`, `usage` and `session_id`. Inside a session the prompt extends the branch its
tokens start with, as `/v1/completions` with token IDs does.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import SampledToken
from tokentape.engines.remote.wire import wire_ids
from tokentape.errors import InvalidRequest
from tokentape.gateway.calls import Call, ChoiceDone, CompletionCall, Event, Started, TextDelta
from tokentape.server.dialects.common import UNAPPLIED_FIELDS, Caller, Number, WireRequest, sampling_from_wire
from tokentape.server.dialects.wire import DONE, TokenText, sse
from tokentape.server.errors import OPENAI_ERRORS
from tokentape.server.serving import Dialect

__all__ = ["GenerateRequest", "GenerateShaper", "VLLMGenerate", "finish_reason", "sampling_params"]

LOGPROB_FLOOR = -9999.0  # vLLM clamps reported logprobs here
_BY_ID = TokenText(None)  # vLLM spells every token of this route by its ID, without bytes


class VLLMSampling(BaseModel):
    """vLLM's `SamplingParams` fields that apply to a token-ID generation; those no engine here applies
    are refused when set (`UNAPPLIED_FIELDS`), others (output formatting) are ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
    n: StrictInt = 1
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    max_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    logprobs: StrictInt | None = None
    skip_special_tokens: StrictBool | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None


class GenerateRequest(WireRequest):
    token_ids: list[StrictInt]
    sampling_params: VLLMSampling
    request_id: StrictStr | None = None


def sampling_params(sp: VLLMSampling, context_length: int, prompt_length: int) -> SamplingParams:
    """vLLM's defaults: OpenAI's, with top_k -1 as off and max_tokens the room left in the context.
    `logprobs: N` asks for the sampled token's logprob and N alternatives."""
    room = max(1, context_length - prompt_length)
    max_tokens = sp.max_tokens if sp.max_tokens is not None else room
    return sampling_from_wire(
        sp, max_tokens=max_tokens, logprobs=sp.logprobs is not None, top_logprobs=sp.logprobs, names=_SAMPLING_NAMES
    )


_WIRE_NAMES = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    *UNAPPLIED_FIELDS,
)
_SAMPLING_NAMES = {
    **{name: f"sampling_params.{name}" for name in _WIRE_NAMES},
    "top_logprobs": "sampling_params.logprobs",
}


class GenerateShaper:
    def __init__(self, req: GenerateRequest, *, session_id: str, prompt: Sequence[int]) -> None:
        self.req = req
        self.request_id = req.request_id or uuid.uuid4().hex
        self.session_id = session_id
        self.prompt = wire_ids(prompt)  # as orjson writes it fastest (the tape's IDs: their text, written once)
        self.prompt_tokens = len(prompt)

    def logprobs(self, tokens: Sequence[SampledToken]) -> dict[str, Any] | None:
        top = self.req.sampling_params.logprobs
        return None if top is None else {"content": _BY_ID.entries(tokens, top, floor=LOGPROB_FLOOR)}

    def _choice(self, index: int, tokens: Sequence[SampledToken], finish: str | None) -> dict[str, Any]:
        return {
            "index": index,
            "token_ids": [t.token_id for t in tokens],
            "finish_reason": finish,
            "logprobs": self.logprobs(tokens),
        }

    def response(self, choices: Sequence[ChoiceDone]) -> dict[str, Any]:
        produced = sum(len(c.tokens) for c in choices)
        return {
            "request_id": self.request_id,
            "choices": [self._choice(c.index, c.tokens, finish_reason(c.finish_reason)) for c in choices],
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "prompt_token_ids": self.prompt,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": produced,
                "total_tokens": self.prompt_tokens + produced,
            },
            "session_id": self.session_id,
        }

    def chunk(self, index: int, tokens: Sequence[SampledToken], finish: str | None) -> dict[str, Any]:
        return {"request_id": self.request_id, "choices": [self._choice(index, tokens, finish)]}


def finish_reason(reason: str) -> str:
    return "abort" if reason == "abort" else "length" if reason == "length" else "stop"


class VLLMGenerate(Dialect[GenerateRequest]):
    """vLLM's token route: `token_ids` and `sampling_params` in, sampled `token_ids` and logprobs out;
    no chat template applied. Inside a session the prompt extends the branch its tokens start with."""

    path = "/inference/v1/generate"  # vLLM's token route lives at the server root, not under /v1
    errors = OPENAI_ERRORS
    request_model = GenerateRequest
    stream_end: ClassVar[bytes] = DONE

    def to_call(self, req: GenerateRequest, raw: dict[str, Any], caller: Caller) -> CompletionCall:
        if not req.token_ids:
            raise InvalidRequest("token_ids must not be empty", param="token_ids")
        return CompletionCall(
            prompt=req.token_ids,
            sampling=sampling_params(req.sampling_params, self.context.context_length, len(req.token_ids)),
            session_id=caller.session_id,
            request_key=caller.request_key,
            retry=caller.retry,
            trace_id=caller.trace_id,
        )

    def respond(self, req: GenerateRequest, call: Call, started: Started, choices: list[ChoiceDone]) -> dict[str, Any]:
        return GenerateShaper(req, session_id=started.session_id, prompt=started.prompt_token_ids).response(choices)

    async def stream(
        self, req: GenerateRequest, call: Call, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        shaper = GenerateShaper(req, session_id=started.session_id, prompt=started.prompt_token_ids)
        async for event in events:
            if isinstance(event, TextDelta) and event.tokens:
                yield sse(shaper.chunk(event.index, event.tokens, None))
            elif isinstance(event, ChoiceDone):
                yield sse(shaper.chunk(event.index, [], finish_reason(event.finish_reason)))

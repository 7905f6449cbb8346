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
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import SampledToken
from tokentape.errors import InvalidRequest
from tokentape.gateway.calls import ChoiceDone, CompletionCall, Event, Started, TextDelta
from tokentape.server.errors import OPENAI_ERRORS
from tokentape.server.serving import Dialect, Origin

__all__ = ["GenerateRequest", "GenerateShaper", "VLLMGenerate", "finish_reason", "sampling_params"]

Number = StrictInt | StrictFloat
LOGPROB_FLOOR = -9999.0  # vLLM clamps reported logprobs here


class VLLMSampling(BaseModel):
    """vLLM's `SamplingParams` fields that apply to a token-ID generation; others are ignored."""

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


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    token_ids: list[StrictInt]
    sampling_params: VLLMSampling
    model: StrictStr | None = None
    stream: StrictBool | None = None
    request_id: StrictStr | None = None
    session_id: StrictStr | None = None


def sampling_params(sp: VLLMSampling, context_length: int, prompt_length: int) -> SamplingParams:
    """vLLM's defaults: temperature 1, no truncation, top_k -1 or 0 off, max_tokens the room left."""
    if sp.logprobs is not None and not 0 <= sp.logprobs <= 20:
        raise InvalidRequest("sampling_params.logprobs must be between 0 and 20", param="sampling_params.logprobs")
    stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    return SamplingParams(
        max_tokens=sp.max_tokens if sp.max_tokens is not None else max(1, context_length - prompt_length),
        temperature=1.0 if sp.temperature is None else float(sp.temperature),
        top_p=1.0 if sp.top_p is None else float(sp.top_p),
        top_k=0 if sp.top_k is None or sp.top_k < 0 else sp.top_k,
        min_p=0.0 if sp.min_p is None else float(sp.min_p),
        seed=sp.seed,
        stop=stop,
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        logprobs=sp.logprobs is not None,
        top_logprobs=sp.logprobs or 0,
        n=sp.n,
    )


class GenerateShaper:
    def __init__(self, req: GenerateRequest, *, session_id: str, prompt: Sequence[int]) -> None:
        self.req = req
        self.request_id = req.request_id or uuid.uuid4().hex
        self.session_id = session_id
        self.prompt = prompt if isinstance(prompt, list) else list(prompt)  # the tape's arrays, for JSON

    def logprobs(self, tokens: Sequence[SampledToken]) -> dict[str, Any] | None:
        top = self.req.sampling_params.logprobs
        if top is None:
            return None
        content = []
        for sample in tokens:
            alternatives = [
                {"token": f"token_id:{t}", "logprob": max(lp, LOGPROB_FLOOR)} for t, lp in sample.top_logprobs[:top]
            ]
            content.append(
                {
                    "token": f"token_id:{sample.token_id}",
                    "token_id": sample.token_id,
                    "logprob": max(sample.logprob, LOGPROB_FLOOR),
                    "bytes": None,
                    "top_logprobs": alternatives,
                }
            )
        return {"content": content}

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
                "prompt_tokens": len(self.prompt),
                "completion_tokens": produced,
                "total_tokens": len(self.prompt) + produced,
            },
            "session_id": self.session_id,
        }

    def chunk(self, index: int, tokens: Sequence[SampledToken], finish: str | None) -> dict[str, Any]:
        return {"request_id": self.request_id, "choices": [self._choice(index, tokens, finish)]}


def finish_reason(reason: str) -> str:
    return "abort" if reason == "abort" else "length" if reason == "length" else "stop"


class VLLMGenerate(Dialect[GenerateRequest]):
    errors = OPENAI_ERRORS
    request_model = GenerateRequest
    stream_end = b"data: [DONE]\n\n"

    def __init__(self, context_length: int) -> None:
        self.context_length = context_length

    def session_field(self, req: GenerateRequest) -> str | None:
        return req.session_id

    def model_field(self, req: GenerateRequest) -> str | None:
        return req.model

    def streams(self, req: GenerateRequest) -> bool:
        return bool(req.stream)

    def call(self, req: GenerateRequest, raw: dict[str, Any], origin: Origin) -> CompletionCall:
        if not req.token_ids:
            raise InvalidRequest("token_ids must not be empty", param="token_ids")
        return CompletionCall(
            prompt=req.token_ids,
            sampling=sampling_params(req.sampling_params, self.context_length, len(req.token_ids)),
            session_id=origin.session_id,
            request_key=origin.request_key,
            retry=origin.retry,
            trace_id=origin.trace_id,
        )

    def respond(self, req: GenerateRequest, started: Started, choices: list[ChoiceDone]) -> dict[str, Any]:
        return GenerateShaper(req, session_id=started.session_id, prompt=started.prompt_token_ids).response(choices)

    async def stream(
        self, req: GenerateRequest, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        shaper = GenerateShaper(req, session_id=started.session_id, prompt=started.prompt_token_ids)
        async for event in events:
            if isinstance(event, TextDelta) and event.tokens:
                yield b"data: " + orjson.dumps(shaper.chunk(event.index, event.tokens, None)) + b"\n\n"
            elif isinstance(event, ChoiceDone):
                chunk = shaper.chunk(event.index, [], finish_reason(event.finish_reason))
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"

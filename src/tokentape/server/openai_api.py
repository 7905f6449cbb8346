"""OpenAI's generation routes as dialects of the serving layer: `/chat/completions` and
`/completions` (with the fields vLLM and trainers add). Each translates its request into a gateway
call and renders the gateway's events as OpenAI objects and SSE chunks (`responses.WireBuilder`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from tokentape.core.messages import flatten_text_parts
from tokentape.core.reply import ToolFormat
from tokentape.core.sampling import SamplingParams
from tokentape.errors import InvalidRequest
from tokentape.gateway.calls import ChatCall, ChoiceDone, CompletionCall, Event, Started, TextDelta
from tokentape.gateway.constraints import output_constraint
from tokentape.gateway.sessions import check_policy
from tokentape.render.renderer import RenderOptions
from tokentape.render.tokenizer import Tokenizer
from tokentape.server.errors import OPENAI_ERRORS
from tokentape.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokentape.server.responses import WireBuilder
from tokentape.server.serving import Dialect, Origin

__all__ = ["OpenAIChat", "OpenAICompletions"]


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _stop(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _sampling(req: SamplingFields, max_tokens: int | None, *, logprobs: bool, top_logprobs: int) -> SamplingParams:
    """OpenAI's defaults for what the request leaves out; SamplingParams checks the ranges."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=req.top_k or 0,
        min_p=0.0 if req.min_p is None else float(req.min_p),
        seed=req.seed,
        stop=_stop(req.stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=1 if req.n is None else req.n,
    )


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a request: text or token IDs, possibly wrapped in a list of one."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(item, int) for item in prompt):
        return [item for item in prompt if isinstance(item, int)]
    if len(prompt) != 1:
        raise InvalidRequest("send one prompt per request", param="prompt")
    (only,) = prompt
    if isinstance(only, str):
        return only
    if isinstance(only, list):
        return [item for item in only if isinstance(item, int)]
    raise InvalidRequest("the prompt must be text or token IDs", param="prompt")


def _include_usage(req: SamplingFields) -> bool:
    return bool((req.stream_options or {}).get("include_usage"))


class _OpenAI(Dialect[Any]):
    errors = OPENAI_ERRORS
    stream_end = b"data: [DONE]\n\n"

    def __init__(self, tokenizer: Tokenizer, tool_format: ToolFormat = "hermes") -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_format  # the model's tool-call syntax, for enforced tool choices

    def session_field(self, req: Any) -> str | None:
        value: str | None = req.session_id
        return value

    def model_field(self, req: Any) -> str | None:
        value: str | None = req.model
        return value

    def streams(self, req: Any) -> bool:
        return bool(req.stream)


class OpenAIChat(_OpenAI):
    request_model = ChatCompletionRequest

    def call(self, req: ChatCompletionRequest, raw: dict[str, Any], origin: Origin) -> ChatCall:
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            raise InvalidRequest("max_completion_tokens must be at least 1", param="max_completion_tokens")
        top = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return ChatCall(
            messages=[flatten_text_parts(m) for m in raw["messages"]],
            # top_logprobs without logprobs: true is a 400 (SamplingParams), as OpenAI answers it
            sampling=_sampling(req, max_tokens, logprobs=bool(req.logprobs), top_logprobs=top),
            options=RenderOptions(tools=req.tools, template_kwargs=req.chat_template_kwargs),
            session_id=origin.session_id,
            rewrite_policy=check_policy(req.rewrite_policy) if req.rewrite_policy is not None else None,
            parse_tool_calls=bool(req.tools) and req.tool_choice != "none",
            request_key=origin.request_key,
            retry=origin.retry,
            trace_id=origin.trace_id,
            constraint=output_constraint(req.tools, req.tool_choice, req.response_format, self.tool_format),
        )

    def _wire(self, req: ChatCompletionRequest, started: Started) -> WireBuilder:
        return WireBuilder(
            self.tokenizer,
            req.model,
            "chat",
            started.session_id,
            started.prompt_token_ids,
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
        )

    def respond(self, req: ChatCompletionRequest, started: Started, choices: list[ChoiceDone]) -> dict[str, Any]:
        return self._wire(req, started).chat_completion(choices, _top(req))

    async def stream(
        self, req: ChatCompletionRequest, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        wire, top = self._wire(req, started), _top(req)
        opened: set[int] = set()
        produced = 0
        async for event in events:
            if isinstance(event, TextDelta):
                yield _sse(
                    wire.chat_chunk(
                        event.index,
                        text=event.text,
                        reasoning=event.reasoning,
                        tokens=event.tokens,
                        top=top,
                        first=event.index not in opened,
                    )
                )
                opened.add(event.index)
            elif isinstance(event, ChoiceDone):
                produced += len(event.tokens)
                yield _sse(
                    wire.chat_chunk(
                        event.index,
                        tool_calls=event.reply.tool_calls,
                        finish_reason=event.finish_reason,
                        first=event.index not in opened,
                    )
                )
                opened.add(event.index)
        if _include_usage(req):
            yield _sse(wire.usage_chunk(produced, "chat.completion.chunk"))


class OpenAICompletions(_OpenAI):
    request_model = CompletionRequest

    def call(self, req: CompletionRequest, raw: dict[str, Any], origin: Origin) -> CompletionCall:
        prompt = _single_prompt(req.prompt)
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise InvalidRequest("logprobs must be between 0 and 5 for completions", param="logprobs")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
        return CompletionCall(
            prompt=prompt,
            sampling=_sampling(req, max_tokens, logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0),
            session_id=origin.session_id,
            echo=bool(req.echo),
            request_key=origin.request_key,
            retry=origin.retry,
            trace_id=origin.trace_id,
        )

    def _wire(self, req: CompletionRequest, started: Started) -> WireBuilder:
        return WireBuilder(
            self.tokenizer,
            req.model,
            "completion",
            started.session_id,
            started.prompt_token_ids,
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
        )

    def _echo(self, req: CompletionRequest) -> str:
        if not req.echo:
            return ""
        prompt = _single_prompt(req.prompt)
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def respond(self, req: CompletionRequest, started: Started, choices: list[ChoiceDone]) -> dict[str, Any]:
        return self._wire(req, started).completion(choices, req.logprobs, self._echo(req))

    async def stream(
        self, req: CompletionRequest, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        wire, echo = self._wire(req, started), self._echo(req)
        opened: set[int] = set()
        produced = 0
        async for event in events:
            if isinstance(event, TextDelta):
                first = event.index not in opened
                text = (echo if first else "") + event.text
                yield _sse(wire.completion_chunk(event.index, text, event.tokens, req.logprobs, None, first))
                opened.add(event.index)
            elif isinstance(event, ChoiceDone):
                first = event.index not in opened
                produced += len(event.tokens)
                yield _sse(wire.completion_chunk(event.index, "", [], req.logprobs, event.finish_reason, first))
                opened.add(event.index)
        if _include_usage(req):
            yield _sse(wire.usage_chunk(produced, "text_completion"))


def _top(req: ChatCompletionRequest) -> int | None:
    """How many alternatives each logprob entry lists; None: no logprobs, as OpenAI answers without
    `logprobs: true` (token IDs are always there, and the tape keeps every logprob either way)."""
    return (req.top_logprobs or 0) if req.logprobs else None

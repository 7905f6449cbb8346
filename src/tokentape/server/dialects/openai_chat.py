"""OpenAI's chat completions (`POST /v1/chat/completions`) and completions (`POST /v1/completions`),
with the fields vLLM and trainers add. Each translates its request into a gateway call and renders
the gateway's events as OpenAI objects and SSE chunks (`WireBuilder`, what the `openai` SDK parses),
plus the token fields vLLM names for `return_token_ids`: `prompt_token_ids` at the top level,
`token_ids` per choice."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from tokentape.core.messages import Message, flatten_text_parts
from tokentape.engines.base import SampledToken
from tokentape.engines.remote.wire import wire_ids
from tokentape.errors import InvalidRequest
from tokentape.gateway.calls import Call, ChatCall, ChoiceDone, CompletionCall, Event, Started, TextDelta
from tokentape.server.dialects.common import Caller, chat_call, sampling_from_wire
from tokentape.server.dialects.images import ImageIntake, LazyIntake, joined, text_part
from tokentape.server.dialects.wire import DONE, TokenText, sse
from tokentape.server.errors import OPENAI_ERRORS
from tokentape.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokentape.server.serving import Dialect

__all__ = ["OpenAIChat", "OpenAICompletions", "WireBuilder", "MAX_COMPLETION_LOGPROBS", "COMPLETION_MAX_TOKENS"]

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on `logprobs` for completions
COMPLETION_MAX_TOKENS = 16  # OpenAI's default `max_tokens` for completions


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


def _has_image_parts(message: Message) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content)


def _with_images(message: Message, index: int, intake: ImageIntake) -> Message:
    """A message with `image_url` parts: the images checked and named by digest. Images come from
    the user or from a tool (a screenshot a tool returned)."""
    where = f"messages[{index}].content"
    if message.get("role") not in ("user", "tool"):
        raise InvalidRequest(f"{where}: images are taken in user and tool messages only", param=where)
    parts: list[Mapping[str, Any]] = []
    for j, part in enumerate(message["content"]):
        if part.get("type") == "text":
            parts.append(text_part(part["text"]))
            continue
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        parts.append(intake.url(url, f"{where}[{j}]"))
    return {**message, "content": joined(parts)}


def _include_usage(req: SamplingFields) -> bool:
    return bool((req.stream_options or {}).get("include_usage"))


OpenAIRequest = TypeVar("OpenAIRequest", bound=SamplingFields)


class _OpenAI(Dialect[OpenAIRequest]):
    errors = OPENAI_ERRORS
    stream_end: ClassVar[bytes] = DONE


class OpenAIChat(_OpenAI[ChatCompletionRequest]):
    """OpenAI chat completions: messages in, one assistant turn sampled and recorded, answered as a
    `ChatCompletion` (or its SSE chunks) with `prompt_token_ids` and each choice's `token_ids`."""

    path = "/v1/chat/completions"
    history_field = "messages"
    request_model = ChatCompletionRequest

    def to_call(self, req: ChatCompletionRequest, raw: dict[str, Any], caller: Caller) -> ChatCall:
        completion_tokens = req.max_completion_tokens is not None
        max_tokens = req.max_completion_tokens if completion_tokens else req.max_tokens
        names = {"max_tokens": "max_completion_tokens"} if completion_tokens else None
        # top_logprobs without logprobs: true is a 400 (SamplingParams), as OpenAI answers it
        logprobs, top = bool(req.logprobs), req.top_logprobs
        sampling = sampling_from_wire(req, max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top, names=names)
        intake = LazyIntake(self.context.image_intake)
        messages: list[Message] = []
        for i, message in enumerate(raw["messages"]):
            if _has_image_parts(message):  # text-only requests never come here
                messages.append(_with_images(message, i, intake()))
            else:
                messages.append(flatten_text_parts(message))
        tools, choice, answer_format = req.tools, req.tool_choice, req.response_format
        images = intake.images
        return chat_call(req, caller, messages, sampling, self.tool_format, tools, choice, answer_format, images=images)

    def _wire(self, req: ChatCompletionRequest, started: Started) -> WireBuilder:
        tokens = TokenText(self.tokenizer, bool(req.return_tokens_as_token_ids))
        return WireBuilder(
            tokens, req.model, "chat", started.session_id, started.prompt_token_ids, self.shows_prompt(req)
        )

    def respond(
        self, req: ChatCompletionRequest, call: Call, started: Started, choices: list[ChoiceDone]
    ) -> dict[str, Any]:
        return self._wire(req, started).chat_completion(choices, _top(req))

    async def stream(
        self, req: ChatCompletionRequest, call: Call, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        wire, top = self._wire(req, started), _top(req)
        opened: set[int] = set()
        produced = 0
        async for event in events:
            if isinstance(event, TextDelta):
                yield sse(
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
                yield sse(
                    wire.chat_chunk(
                        event.index,
                        tool_calls=event.reply.tool_calls,
                        finish_reason=event.finish_reason,
                        first=event.index not in opened,
                    )
                )
                opened.add(event.index)
        if _include_usage(req):
            yield sse(wire.usage_chunk(produced, "chat.completion.chunk"))


class OpenAICompletions(_OpenAI[CompletionRequest]):
    """OpenAI text completions: one prompt (text or token IDs) in, no chat template applied, answered
    as a `Completion` (or its SSE chunks); inside a session the prompt extends the branch it starts with."""

    path = "/v1/completions"
    request_model = CompletionRequest

    def to_call(self, req: CompletionRequest, raw: dict[str, Any], caller: Caller) -> CompletionCall:
        prompt = _single_prompt(req.prompt)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS} for completions", param="logprobs"
            )
        max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        return CompletionCall(
            prompt=prompt,
            sampling=sampling_from_wire(
                req, max_tokens=max_tokens, logprobs=req.logprobs is not None, top_logprobs=req.logprobs
            ),
            session_id=caller.session_id,
            echo=bool(req.echo),
            request_key=caller.request_key,
            retry=caller.retry,
            trace_id=caller.trace_id,
        )

    def _wire(self, req: CompletionRequest, started: Started) -> WireBuilder:
        tokens = TokenText(self.tokenizer, bool(req.return_tokens_as_token_ids))
        return WireBuilder(
            tokens, req.model, "completion", started.session_id, started.prompt_token_ids, self.shows_prompt(req)
        )

    def _echo(self, req: CompletionRequest) -> str:
        if not req.echo:
            return ""
        prompt = _single_prompt(req.prompt)
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def respond(
        self, req: CompletionRequest, call: Call, started: Started, choices: list[ChoiceDone]
    ) -> dict[str, Any]:
        return self._wire(req, started).completion(choices, req.logprobs, self._echo(req))

    async def stream(
        self, req: CompletionRequest, call: Call, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        wire, echo = self._wire(req, started), self._echo(req)
        opened: set[int] = set()
        produced = 0
        async for event in events:
            if isinstance(event, TextDelta):
                first = event.index not in opened
                text = (echo if first else "") + event.text
                yield sse(wire.completion_chunk(event.index, text, event.tokens, req.logprobs, None, first))
                opened.add(event.index)
            elif isinstance(event, ChoiceDone):
                first = event.index not in opened
                produced += len(event.tokens)
                yield sse(wire.completion_chunk(event.index, "", [], req.logprobs, event.finish_reason, first))
                opened.add(event.index)
        if _include_usage(req):
            yield sse(wire.usage_chunk(produced, "text_completion"))


def _top(req: ChatCompletionRequest) -> int | None:
    """How many alternatives each logprob entry lists; None: no logprobs, as OpenAI answers without
    `logprobs: true` (token IDs are always there, and the tape keeps every logprob either way)."""
    return (req.top_logprobs or 0) if req.logprobs else None


class WireBuilder:
    """Shapes one response; holds its id, creation time and model name."""

    def __init__(
        self, tokens: TokenText, model: str, kind: str, session_id: str, prompt: Sequence[int], show_prompt: bool = True
    ) -> None:
        self.tokens = tokens
        self.model = model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.session_id = session_id
        # as orjson writes it fastest: the tape's IDs carry their JSON text, written once for the engine
        # and this response (a list of Python ints: 3.5 ms at 128k tokens, on every response)
        self.prompt = wire_ids(prompt)
        self.prompt_tokens = len(prompt)
        self.prompt_field = {"prompt_token_ids": self.prompt} if show_prompt else {}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chat_logprobs(self, tokens: Sequence[SampledToken], top: int) -> dict[str, Any]:
        return {"content": self.tokens.entries(tokens, top), "refusal": None}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = self.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def _whole(self, obj: str, choices: Sequence[ChoiceDone], shaped: list[dict[str, Any]]) -> dict[str, Any]:
        """A whole response: its choices, usage, and the token data of the prompt and session."""
        return {
            **self._head(obj),
            "choices": shaped,
            "usage": self.usage(sum(len(c.tokens) for c in choices)),
            **self.prompt_field,
            "session_id": self.session_id,
        }

    def _chunk(self, obj: str, choice: dict[str, Any], tokens: Sequence[SampledToken], first: bool) -> dict[str, Any]:
        """One stream chunk of one choice; the first of a choice names the prompt and the session."""
        choice["token_ids"] = [t.token_id for t in tokens]
        chunk: dict[str, Any] = {**self._head(obj), "choices": [choice]}
        if first:
            chunk.update(self.prompt_field)
            chunk["session_id"] = self.session_id
        return chunk

    # -- chat ------------------------------------------------------------------------------------
    def chat_completion(self, choices: Sequence[ChoiceDone], top: int | None) -> dict[str, Any]:
        """`top`: alternatives per logprob entry; None for no logprobs."""
        shaped = [
            {
                "index": c.index,
                "message": c.reply.message(),
                "finish_reason": c.finish_reason,
                "logprobs": None if top is None else self.chat_logprobs(c.tokens, top),
                "token_ids": [t.token_id for t in c.tokens],
            }
            for c in choices
        ]
        return self._whole("chat.completion", choices, shaped)

    def chat_chunk(
        self,
        index: int,
        *,
        text: str | None = None,
        reasoning: str | None = None,
        tool_calls: Sequence[dict[str, Any]] = (),
        tokens: Sequence[SampledToken] = (),
        top: int | None = None,
        finish_reason: str | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        logprobs = self.chat_logprobs(tokens, top) if tokens and top is not None else None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._chunk("chat.completion.chunk", choice, tokens, first)

    def usage_chunk(self, completion_tokens: int, obj: str) -> dict[str, Any]:
        return {**self._head(obj), "choices": [], "usage": self.usage(completion_tokens)}

    # -- completions -------------------------------------------------------------------------------
    def completion_logprobs(self, tokens: Sequence[SampledToken], top: int, offset: int) -> dict[str, Any]:
        text = self.tokens.text
        texts = [text(t.token_id) for t in tokens]
        offsets = []
        for sample in tokens:
            offsets.append(offset)
            offset += len(self.tokens.decoded(sample.token_id))
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{text(i): lp for i, lp in t.top_logprobs[:top]} for t in tokens],
            "text_offset": offsets,
        }

    def completion(self, choices: Sequence[ChoiceDone], top: int | None, echo: str) -> dict[str, Any]:
        shaped = [
            {
                "index": c.index,
                "text": echo + c.text,
                "finish_reason": c.finish_reason,
                "logprobs": None if top is None else self.completion_logprobs(c.tokens, top, len(echo)),
                "token_ids": [t.token_id for t in c.tokens],
                **self.prompt_field,  # per choice too, where vLLM and verifiers look
            }
            for c in choices
        ]
        return self._whole("text_completion", choices, shaped)

    def completion_chunk(
        self,
        index: int,
        text: str,
        tokens: Sequence[SampledToken],
        top: int | None,
        finish_reason: str | None,
        first: bool,
    ) -> dict[str, Any]:
        logprobs = None if top is None else self.completion_logprobs(tokens, top, 0)
        choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        return self._chunk("text_completion", choice, tokens, first)

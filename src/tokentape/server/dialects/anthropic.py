"""Anthropic Messages (`POST /v1/messages`) <-> the gateway's chat turn, and its token count
(`POST /v1/messages/count_tokens`).

Requests: `system` becomes the system message (a text block that starts with Claude Code's
`x-anthropic-billing-header:` is left out: a per-request attribution line, not instructions); a
`system` message inside `messages` becomes a system message at its place; content blocks become chat
messages (`tool_use` -> the assistant's tool calls, `tool_result` -> tool messages, `thinking` -> the
assistant's reasoning); tools with `input_schema` become chat tools; `tool_choice` {auto, any, tool,
none} the chat forms; `stop_sequences` stop strings. `thinking` `enabled` or `adaptive` turns the
template's thinking switch on (`enable_thinking`), `disabled` or none off; `display: omitted` answers
thinking blocks with empty text (the tape keeps every sampled token); `output_config.effort` is the
template's `reasoning_effort` (vLLM's mapping). What Anthropic's API keeps or
bills on its side is accepted and has no effect here: `cache_control` on any block, `metadata`,
a thinking budget, tools' `defer_loading`, and the `clear_thinking_20251015`
context edit (which earlier reasoning the model sees is the chat template's rule; a history the
client changed goes through the rewrite policy). Other context edits are refused in Anthropic's
words, which Claude Code reads as "stop sending it". The full table of fields is in
docs/guides/harness-fields.md. An assistant message echoed back is recognised as the reply that was
returned (its tool_use input compared as parsed JSON), so the tape extends.

Responses: built as the `anthropic` package's own `Message` and stream-event types (validated), with
the stop reason in Anthropic's words, plus the token data (`prompt_token_ids`, `token_ids`,
`session_id`, and `logprobs` when the request asks with `logprobs: true`; `top_logprobs` needs it,
as on chat completions). Trainers' fields are the chat route's: `top_k`, `min_p`, `seed`,
`chat_template_kwargs`, `rewrite_policy`, `return_tokens_as_token_ids`.
Errors are Anthropic's shape (`server.errors.ANTHROPIC_ERRORS`).

This module is the dialect (`AnthropicMessages`) and the token count's route; the request is read in
`anthropic_input`, the answer shaped in `anthropic_output`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import Response

from tokentape.core.sampling import SamplingParams
from tokentape.core.session import SessionTree
from tokentape.core.tape import FinishReason
from tokentape.engines.base import SampledToken
from tokentape.errors import InvalidRequest
from tokentape.gateway.calls import Call, ChatCall, ChoiceDone, Event, Started, TextDelta
from tokentape.render.renderer import RenderOptions
from tokentape.server.bodies import json_object
from tokentape.server.dialects.anthropic_input import (
    CountTokensRequest,
    MessagesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    check_context_edits,
    effort_of,
    thinking_on,
    thinking_shown,
)
from tokentape.server.dialects.anthropic_output import MessageShaper, finish_words
from tokentape.server.dialects.common import Caller, chat_call, sampling_from_wire
from tokentape.server.dialects.images import LazyIntake
from tokentape.server.dialects.wire import TokenText, named_sse
from tokentape.server.errors import ANTHROPIC_ERRORS, invalid_from_validation, json_response, use_error_shape
from tokentape.server.serving import Dialect, DialectContext, Serving

__all__ = ["COUNT_TOKENS_PATH", "AnthropicMessages", "count_tokens_route"]


# -- the dialect -----------------------------------------------------------------------------------
class AnthropicMessages(Dialect[MessagesRequest]):
    """Anthropic Messages: `system` and content blocks in, one assistant turn sampled and recorded,
    answered as a `Message` (or its stream events) with the token data."""

    path = "/v1/messages"
    history_field = "messages"
    errors = ANTHROPIC_ERRORS
    request_model = MessagesRequest

    def __init__(self, context: DialectContext) -> None:
        super().__init__(context)
        self.reasoning = context.reasoning  # the template reads `enable_thinking`
        self._end_of_turn = context.tokenizer.end_of_turn_ids

    def _prompt_parts(
        self, req: CountTokensRequest
    ) -> tuple[list[dict[str, Any]], LazyIntake, list[dict[str, Any]] | None, Any, dict[str, Any] | None]:
        """What decides the prompt: the messages (and their images), the tools, the tool choice and
        the template's thinking switch; shared by generation and `count_tokens`."""
        check_context_edits(req.context_management, req.model)
        images = LazyIntake(self.context.image_intake)
        messages = chat_messages(req.system, req.messages, images)
        if not any(m["role"] != "system" for m in messages):
            raise InvalidRequest("messages must not be empty", param="messages")
        switch, effort = thinking_on(req.thinking), effort_of(req.output_config)
        kwargs: dict[str, Any] = {"enable_thinking": switch} if self.reasoning else {}
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        return messages, images, chat_tools(req.tools), chat_tool_choice(req.tool_choice), kwargs or None

    def count_call(self, req: CountTokensRequest) -> ChatCall:
        """A count request as the chat call a generation with the same prompt would make."""
        messages, images, tools, _, thinking = self._prompt_parts(req)
        kwargs = thinking if req.chat_template_kwargs is None else {**(thinking or {}), **req.chat_template_kwargs}
        return ChatCall(
            messages=messages,
            sampling=SamplingParams(),
            options=RenderOptions(tools=tools, template_kwargs=kwargs),
            images=images.images or {},
            has_images=images.images is not None,
        )

    def to_call(self, req: MessagesRequest, raw: dict[str, Any], caller: Caller) -> ChatCall:
        messages, images, tools, choice, thinking = self._prompt_parts(req)
        # top_logprobs without logprobs: true is a 400 (SamplingParams), as on chat completions
        sampling = sampling_from_wire(
            req,
            max_tokens=req.max_tokens,
            logprobs=bool(req.logprobs),
            top_logprobs=req.top_logprobs,
            stop=req.stop_sequences,
            names={"stop": "stop_sequences"},
        )
        answer_format = (req.output_config or {}).get("format")
        return chat_call(
            req,
            caller,
            messages,
            sampling,
            self.tool_format,
            tools,
            choice,
            answer_format,
            template_kwargs=thinking,
            images=images.images,
        )

    def _shaper(self, req: MessagesRequest, started: Started) -> MessageShaper:
        def stopped_by(tokens: Sequence[SampledToken], finish: FinishReason) -> tuple[str, str | None]:
            """Anthropic's stop reason, and the stop sequence that ended the reply if one did. A reply
            cut at the end of the context (a `max_tokens` past the room left, clipped to it) stopped
            for Anthropic's `model_context_window_exceeded`, not for the `max_tokens` the client set."""
            if finish == "length" and len(started.prompt_token_ids) + len(tokens) >= self.context.context_length:
                return "model_context_window_exceeded", None
            if finish != "stop":
                return finish_words(finish), None
            if tokens and tokens[-1].token_id in self._end_of_turn:
                return "end_turn", None
            text = self.tokenizer.decode([t.token_id for t in tokens])
            found = [(text.find(stop), stop) for stop in req.stop_sequences or () if stop in text]
            return ("stop_sequence", min(found)[1]) if found else ("end_turn", None)

        return MessageShaper(
            req,
            session_id=started.session_id,
            prompt=started.prompt_token_ids,
            tokens=TokenText(self.tokenizer, bool(req.return_tokens_as_token_ids)),
            stopped_by=stopped_by,
            show_prompt=self.shows_prompt(req),
            show_thinking=thinking_shown(req.thinking),
        )

    def respond(self, req: MessagesRequest, call: Call, started: Started, choices: list[ChoiceDone]) -> dict[str, Any]:
        (done,) = choices
        return self._shaper(req, started).message(done)

    async def stream(
        self, req: MessagesRequest, call: Call, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        shaper = self._shaper(req, started)
        for opened in shaper.opening():
            yield named_sse(opened)
        async for event in events:
            if isinstance(event, TextDelta):
                for shaped in shaper.delta(event):
                    yield named_sse(shaped)
            elif isinstance(event, ChoiceDone):
                for shaped in shaper.closing(event):
                    yield named_sse(shaped)


# -- counting tokens -------------------------------------------------------------------------------
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"  # also under /sessions/{session_id}


def count_tokens_route(serving: Serving, dialect: AnthropicMessages) -> Callable[[Request], Any]:
    """`POST /v1/messages/count_tokens`: the number of prompt tokens a generation with the same
    messages, system, tools, tool choice and thinking would send the engine, as a new conversation
    (`{"input_tokens": N}`). Planned exactly as a generation's first prompt is (same template, same
    tools, images expanded), on a session of its own that nothing keeps: nothing is recorded. Inside
    a session whose tape holds sampled tokens the template would render otherwise (reasoning it
    strips, re-serialised tool arguments), the engine's prompt is the tape's and can differ by those."""

    async def count_tokens(request: Request) -> Response:
        """Anthropic Messages' token count: `model`, `messages`, `system`, `tools`, `tool_choice`,
        `thinking` in, `{"input_tokens": N}` out, N the prompt a generation with them would send the
        engine as a new conversation. Nothing is recorded; errors in Anthropic's shape."""
        use_error_shape(request, ANTHROPIC_ERRORS)
        raw = await json_object(request, first=serving.check_body_model)  # as a generation's: model first
        try:
            req = CountTokensRequest.model_validate(raw)
        except pydantic.ValidationError as exc:
            raise invalid_from_validation(exc) from exc
        plan = await serving.gateway.planner.chat(SessionTree("count-tokens"), dialect.count_call(req))
        body: dict[str, Any] = {"input_tokens": len(plan.prompt)}
        if req.context_management is not None:  # no edit here removes anything
            body["context_management"] = {"original_input_tokens": len(plan.prompt)}
        return json_response(body)

    return count_tokens

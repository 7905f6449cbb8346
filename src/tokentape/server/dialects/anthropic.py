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
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Annotated, Any

import pydantic
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, StrictBool, StrictInt, StrictStr

from tokentape.core.sampling import SamplingParams
from tokentape.core.session import SessionTree
from tokentape.core.tape import FinishReason
from tokentape.engines.base import SampledToken
from tokentape.engines.remote.wire import wire_ids
from tokentape.errors import InvalidRequest
from tokentape.gateway.calls import Call, ChatCall, ChoiceDone, Event, Started, TextDelta
from tokentape.render.renderer import RenderOptions
from tokentape.server.bodies import json_object
from tokentape.server.dialects import common
from tokentape.server.dialects.common import Caller, ChatFields, Number, chat_call, sampling_from_wire
from tokentape.server.dialects.images import ImageIntake, LazyIntake, joined, text_only_intake, text_part
from tokentape.server.dialects.wire import TokenText, named_sse
from tokentape.server.errors import ANTHROPIC_ERRORS, invalid_from_validation, json_response, use_error_shape
from tokentape.server.protocol import MAX_MESSAGES
from tokentape.server.serving import Dialect, DialectContext, Serving

__all__ = [
    "COUNT_TOKENS_PATH",
    "CountTokensRequest",
    "count_tokens_route",
    "MessagesRequest",
    "MessageShaper",
    "chat_messages",
    "chat_tools",
    "chat_tool_choice",
    "check_event",
    "check_message",
    "AnthropicMessages",
]


class CountTokensRequest(ChatFields):
    """`POST /v1/messages/count_tokens`: what decides the prompt, none of what decides the reply."""

    model: StrictStr
    messages: Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    # {"format": {"type": "json_schema", "schema": ...}, "effort": "high"}
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    metadata: dict[str, Any] | None = None  # accepted: Claude Code's `user_id` names its session
    # what trainers add, besides ChatFields
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


# Claude Code's first system block: an attribution line that changes with every version and entry
# point (`x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;`). Anthropic reads it and
# keeps it out of the prompt; so does vLLM's Messages route. A block starting with exactly this text.
BILLING_HEADER = "x-anthropic-billing-header:"
THINKING_TYPES = ("enabled", "adaptive", "disabled")
THINKING_DISPLAYS = ("summarized", "omitted")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Context edits of state Anthropic's API keeps: which earlier thinking it shows the model. Here the
# chat template decides that, and the tape keeps every sampled token: accepted, nothing to do.
ACCEPTED_CONTEXT_EDITS = ("clear_thinking_20251015",)


# -- requests --------------------------------------------------------------------------------------
def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, Mapping) for b in content):
        raise InvalidRequest(f"{where}.content must be text or a list of content blocks", param=f"{where}.content")
    return content


def _plain_text(content: Any, where: str) -> str:
    texts = []
    for j, block in enumerate(_blocks(content, where)):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise InvalidRequest(
                f"{where}.content[{j}]: only text blocks are supported here (got {block.get('type')!r})",
                param=f"{where}.content",
            )
        texts.append(block["text"])
    return "".join(texts)


def _image(block: Mapping[str, Any], where: str, intake: Callable[[], ImageIntake]) -> dict[str, Any]:
    """An `image` block (base64 source; a url source only as the intake allows) as an image part."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise InvalidRequest(f"{where}.source must be an object", param=where)
    if source.get("type") == "base64":
        return intake().base64(source.get("media_type"), source.get("data"), where)
    if source.get("type") == "url":
        return intake().url(source.get("url"), where)
    raise InvalidRequest(f"{where}.source.type must be 'base64' or 'url'", param=where)


def _tool_result(result: Any, where: str, intake: Callable[[], ImageIntake]) -> str | list[Mapping[str, Any]]:
    """A tool result's content: text, or text and images (a screenshot a tool returned)."""
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    blocks = _blocks(result, where)
    if not any(block.get("type") == "image" for block in blocks):
        return _plain_text(result, where)
    parts: list[Mapping[str, Any]] = []
    for j, block in enumerate(blocks):
        if block.get("type") == "image":
            parts.append(_image(block, f"{where}.content[{j}]", intake))
        elif block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(text_part(block["text"]))
        else:
            raise InvalidRequest(
                f"{where}.content[{j}]: blocks of type {block.get('type')!r} are not supported", param=where
            )
    return joined(parts)


def system_prompt(system: str | Sequence[Mapping[str, Any]] | None) -> str | None:
    """The `system` field's text, without the billing-header block Claude Code puts first."""
    if not system:
        return None
    if isinstance(system, str):
        return system
    blocks = _blocks(system, "system")
    kept = [
        block
        for block in blocks
        if not (block.get("type") == "text" and str(block.get("text", "")).startswith(BILLING_HEADER))
    ]
    return _plain_text(kept, "system") if kept else None


def chat_messages(
    system: str | Sequence[Mapping[str, Any]] | None,
    messages: Sequence[Mapping[str, Any]],
    intake: Callable[[], ImageIntake] | None = None,
) -> list[dict[str, Any]]:
    """Messages as chat messages; `intake` gives the request's image intake (made on the first image).
    A `system` message inside `messages` (Claude Code sends its environment so, after the first user
    turn) stays a system message at its place; whether the template can render it there is the
    renderer's to say."""
    images = intake or text_only_intake
    out: list[dict[str, Any]] = []
    prompt = system_prompt(system)
    if prompt is not None:
        out.append({"role": "system", "content": prompt})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise InvalidRequest(f"{where}.role must be 'user', 'assistant' or 'system'", param=f"{where}.role")
        if role == "system":
            out.append({"role": "system", "content": _plain_text(message.get("content"), where)})
            continue
        blocks = _blocks(message.get("content"), where)
        if role == "assistant":
            out.append(_assistant(blocks, where))
            continue
        texts: list[str] = []
        parts: list[Mapping[str, Any]] | None = None  # text and images, once the message holds an image
        for j, block in enumerate(blocks):
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                if parts is None:
                    texts.append(block["text"])
                else:
                    parts.append(text_part(block["text"]))
            elif kind == "image":
                parts = [text_part(text) for text in texts] if parts is None else parts
                parts.append(_image(block, f"{where}.content[{j}]", images))
            elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
                content = _tool_result(block.get("content"), f"{where}.content[{j}]", images)
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
            else:
                raise InvalidRequest(
                    f"{where}.content[{j}]: blocks of type {kind!r} are not supported", param=f"{where}.content"
                )
        if parts is not None:
            out.append({"role": "user", "content": joined(parts)})
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks: Sequence[Mapping[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input"), Mapping):
            arguments = json.dumps(block["input"], ensure_ascii=False)
            calls.append(
                {"id": block.get("id"), "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        else:
            raise InvalidRequest(
                f"{where}.content[{j}]: blocks of type {kind!r} are not supported", param=f"{where}.content"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
            raise InvalidRequest(f"tools[{i}]: only custom tools with a name are supported", param=f"tools[{i}]")
        out.append(common.chat_function_tool(tool, "input_schema"))
    return out


def chat_tool_choice(tool_choice: Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    if tool_choice is None:
        return None
    kind = tool_choice.get("type")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": tool_choice.get("name")}}
    raise InvalidRequest("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice.type")


def thinking_on(thinking: Mapping[str, Any] | None) -> bool:
    """Whether `thinking` turns the template's thinking switch on: `enabled` and `adaptive` (the
    model decides how much to think, as a template with the switch on lets it) do, `disabled` and
    no `thinking` do not. A budget is accepted with no effect: no engine here caps the reasoning
    apart from the reply."""
    if thinking is None:
        return False
    kind, display = thinking.get("type"), thinking.get("display")
    if kind not in THINKING_TYPES:
        raise InvalidRequest("thinking.type must be 'enabled', 'adaptive' or 'disabled'", param="thinking.type")
    if display is not None and display not in THINKING_DISPLAYS:
        raise InvalidRequest("thinking.display must be 'summarized' or 'omitted'", param="thinking.display")
    return bool(kind != "disabled")


def thinking_shown(thinking: Mapping[str, Any] | None) -> bool:
    """Whether thinking blocks carry their text: not with `display: omitted` (they come with empty
    text, as Anthropic sends them; the tokens are on the tape and in `token_ids` all the same)."""
    return (thinking or {}).get("display") != "omitted"


def check_context_edits(context_management: Mapping[str, Any] | None, model: str) -> None:
    """Context edits change state Anthropic's API keeps. `clear_thinking_20251015` is accepted (the
    chat template decides which earlier reasoning it renders; a client that drops thinking blocks
    from its history changes that history, which the rewrite policy handles). Any other edit, such as
    clearing old tool results, would change what the model sees without the client knowing: refused
    in Anthropic's words, on which Claude Code stops sending it and keeps the tool results."""
    if context_management is None:
        return
    edits = context_management.get("edits", [])
    if not isinstance(edits, list):
        raise InvalidRequest("context_management.edits must be a list", param="context_management.edits")
    for j, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, Mapping) else None
        if kind not in ACCEPTED_CONTEXT_EDITS:
            raise InvalidRequest(
                f"{model} does not support the `{kind}` context management strategy",
                param=f"context_management.edits[{j}].type",
            )


def effort_of(output_config: Mapping[str, Any] | None) -> str | None:
    """`output_config.effort`, Anthropic's dial for how thoroughly Claude works (thinking, tool calls,
    length). No engine has such a knob; as vLLM's Messages route does, it is given to the chat template
    as `reasoning_effort` (gpt-oss templates read it; Qwen's and most others render unchanged)."""
    effort = (output_config or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(f"output_config.effort must be one of {', '.join(EFFORTS)}", param="output_config.effort")
    return effort if isinstance(effort, str) else None


# -- responses -------------------------------------------------------------------------------------
def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessageShaper:
    """Shapes one reply: the whole `Message`, or the stream of events that builds it."""

    def __init__(
        self,
        req: MessagesRequest,
        *,
        session_id: str,
        prompt: Sequence[int],
        tokens: TokenText,
        stopped_by: Any,
        show_prompt: bool = True,
        show_thinking: bool = True,
    ) -> None:
        self.req = req
        self.id = f"msg_{uuid.uuid4().hex}"
        self.session_id = session_id
        self.prompt = wire_ids(prompt)  # as orjson writes it fastest (the tape's IDs: their text, written once)
        self.prompt_tokens = len(prompt)
        self.prompt_field = {"prompt_token_ids": self.prompt} if show_prompt else {}
        self.tokens = tokens
        self.show_thinking = show_thinking  # `display: omitted`: thinking blocks with empty text
        self._stopped_by = stopped_by  # (tokens, finish reason) -> (stop_reason, stop_sequence)
        self._index = -1
        self._open: str | None = None  # the kind of the block being streamed

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model}

    def content(self, done: ChoiceDone) -> list[dict[str, Any]]:
        reply = done.reply
        blocks: list[dict[str, Any]] = []
        if reply.reasoning:
            shown = reply.reasoning if self.show_thinking else ""
            blocks.append({"type": "thinking", "thinking": shown, "signature": ""})
        if reply.content or not (reply.reasoning or reply.tool_calls):
            blocks.append({"type": "text", "text": reply.content})
        for call in reply.tool_calls:
            blocks.append(self._tool_use(call))
        return blocks

    @staticmethod
    def _tool_use(call: Mapping[str, Any]) -> dict[str, Any]:
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = {}
        return {
            "type": "tool_use",
            "id": _tool_id(call["id"]),
            "name": function["name"],
            "input": arguments if isinstance(arguments, dict) else {"value": arguments},
        }

    def stop(self, done: ChoiceDone) -> tuple[str, str | None]:
        if done.reply.tool_calls and done.finish_reason in ("stop", "tool_calls"):
            return "tool_use", None
        reason: tuple[str, str | None] = self._stopped_by(done.tokens, done.finish_reason)
        return reason

    def message(self, done: ChoiceDone) -> dict[str, Any]:
        stop_reason, stop_sequence = self.stop(done)
        body = {
            **self._head(),
            "content": self.content(done),
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": len(done.tokens)},
            **self.prompt_field,
            "token_ids": [t.token_id for t in done.tokens],
            "session_id": self.session_id,
        }
        if self.req.logprobs:
            body["logprobs"] = self.logprobs(done.tokens)
        return body

    def logprobs(self, tokens: Sequence[SampledToken]) -> list[dict[str, Any]]:
        return self.tokens.entries(tokens, self.req.top_logprobs or 0)

    # -- the stream ----------------------------------------------------------------------------------
    def opening(self) -> Iterator[dict[str, Any]]:
        message = {
            **self._head(),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
            **self.prompt_field,
            "session_id": self.session_id,
        }
        yield {"type": "message_start", "message": message}

    def _close(self) -> Iterator[dict[str, Any]]:
        if self._open is not None:
            self._open = None
            yield {"type": "content_block_stop", "index": self._index}

    def _start(self, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._close()
        self._index += 1
        self._open = block["type"]
        yield {"type": "content_block_start", "index": self._index, "content_block": block}

    def delta(self, event: TextDelta) -> Iterator[dict[str, Any]]:
        if event.reasoning:
            if self._open != "thinking":
                yield from self._start({"type": "thinking", "thinking": "", "signature": ""})
            if self.show_thinking:
                yield {
                    "type": "content_block_delta",
                    "index": self._index,
                    "delta": {"type": "thinking_delta", "thinking": event.reasoning},
                }
        if event.text:
            if self._open == "thinking":
                yield {
                    "type": "content_block_delta",
                    "index": self._index,
                    "delta": {"type": "signature_delta", "signature": ""},
                }
            if self._open != "text":
                yield from self._start({"type": "text", "text": ""})
            yield {
                "type": "content_block_delta",
                "index": self._index,
                "delta": {"type": "text_delta", "text": event.text},
            }

    def closing(self, done: ChoiceDone) -> Iterator[dict[str, Any]]:
        if self._index < 0 and not done.reply.tool_calls:
            yield from self._start({"type": "text", "text": ""})  # an empty reply is one empty text block
        for call in done.reply.tool_calls:
            block = self._tool_use(call)
            yield from self._start({**block, "input": {}})
            partial = json.dumps(block["input"], ensure_ascii=False)
            yield {
                "type": "content_block_delta",
                "index": self._index,
                "delta": {"type": "input_json_delta", "partial_json": partial},
            }
        yield from self._close()
        stop_reason, stop_sequence = self.stop(done)
        usage: dict[str, Any] = {"output_tokens": len(done.tokens)}
        delta: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage,
        }
        delta["token_ids"] = [t.token_id for t in done.tokens]
        if self.req.logprobs:
            delta["logprobs"] = self.logprobs(done.tokens)
        yield delta
        yield {"type": "message_stop"}


def finish_words(finish: FinishReason) -> str:
    return {"length": "max_tokens", "abort": "max_tokens"}.get(finish, "end_turn")


_EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)


def check_message(body: dict[str, Any]) -> dict[str, Any]:
    """The body checked against the `anthropic` package's own `Message` type, so that a shape the
    SDK would misread fails in the tests. Never on the serving path: the turn is recorded by then."""
    AnthropicMessage.model_validate(body)
    return body


def check_event(event: dict[str, Any]) -> dict[str, Any]:
    """One stream event checked against the `anthropic` package's event union (used by the tests)."""
    _EVENTS.validate_python(event)
    return event


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
        raw = await json_object(request)
        try:
            req = CountTokensRequest.model_validate(raw)
        except pydantic.ValidationError as exc:
            raise invalid_from_validation(exc) from exc
        serving.check_model(req.model)
        plan = await serving.gateway.planner.chat(SessionTree("count-tokens"), dialect.count_call(req))
        body: dict[str, Any] = {"input_tokens": len(plan.prompt)}
        if req.context_management is not None:  # no edit here removes anything
            body["context_management"] = {"original_input_tokens": len(plan.prompt)}
        return json_response(body)

    return count_tokens

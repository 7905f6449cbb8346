"""A Responses request read into a chat turn: the request's fields (`ResponsesRequest`), its input items
(messages, `function_call`, `function_call_output`, `reasoning`) as chat messages, `text.format` as the
response format, and the fields no engine here applies refused by name. The tools are
`responses_tools`; the dialect that puts these together is `responses`."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt, StrictStr

from tokentape.errors import InvalidRequest
from tokentape.server.dialects.common import ChatFields, Number
from tokentape.server.dialects.images import ImageIntake, joined, text_only_intake, text_part
from tokentape.server.dialects.responses_tools import ToolTable

__all__ = [
    "ENCRYPTED_INCLUDE",
    "LOGPROBS_INCLUDE",
    "MAX_INPUT_ITEMS",
    "ResponsesRequest",
    "carried_reasoning",
    "chat_messages",
    "refuse_unapplied",
    "response_format",
]

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_INPUT_ITEMS = 4096  # as many as chat messages


class ResponsesRequest(ChatFields):
    """The fields of `responses.create` this gateway reads; others are accepted and ignored. What each
    field does here is tabled in docs/guides/harness-fields.md ("Responses (Codex)")."""

    model: StrictStr
    input: StrictStr | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)] = ""
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_logprobs: StrictInt | None = None
    include: list[StrictStr] | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None  # OpenAI's Metadata: string values, echoed in the Response
    # `effort` is given to the template as `reasoning_effort` (vLLM's mapping); `summary` is accepted:
    # the reasoning comes back whole, as `reasoning_text`, and no summary is made of it
    reasoning: dict[str, Any] | None = None
    # accepted, sampling unchanged: a prompt-cache routing hint (Codex: its session id, which may name
    # the session), the harness's own ids, end-user ids, the service tier, stream obfuscation
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    client_metadata: dict[str, Any] | None = None
    safety_identifier: StrictStr | None = None
    user: StrictStr | None = None
    service_tier: StrictStr | None = None
    stream_options: dict[str, Any] | None = None
    # refused when set to anything but their no-op value (`refuse_unapplied`)
    truncation: StrictStr | None = None
    background: StrictBool | None = None
    conversation: StrictStr | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: StrictInt | None = None
    context_management: list[Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


# -- input items --------------------------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    """Text of a message's content: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be text or a list of text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"{where}.content[{j}]: only text parts are supported (got {kind!r})", param=f"{where}.content"
            )
        texts.append(part["text"])
    return "".join(texts)


# `include: ["reasoning.encrypted_content"]`: a reasoning item carries its text in `encrypted_content`,
# so that an agent that resends the history with `store: false` (and drops `content`, as Codex does)
# gives it back whole. Not encrypted: the text, base64-encoded behind this prefix.
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
_CARRIED = "tokentape-reasoning-v1:"


def carried_reasoning(text: str) -> str:
    """The `encrypted_content` that carries `text`."""
    return _CARRIED + base64.b64encode(text.encode()).decode()


def _reasoning_text(item: Mapping[str, Any]) -> str:
    """A resent reasoning item's text: what `encrypted_content` carries (when this gateway wrote it),
    else its `content`, else its summary. Content another server encrypted cannot be read: then the
    summary, or nothing (the session keeps the sampled tokens either way)."""
    carried = item.get("encrypted_content")
    if isinstance(carried, str) and carried.startswith(_CARRIED):
        try:
            return base64.b64decode(carried[len(_CARRIED) :], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            pass
    parts = item.get("content") or item.get("summary") or []
    return "".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping))


def _content(content: Any, where: str, intake: Callable[[], ImageIntake]) -> str | list[Mapping[str, Any]]:
    """A user message's or function output's content: text, or text and `input_image` parts."""
    if not (
        isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") == "input_image" for p in content)
    ):
        return _text_of(content, where)
    parts: list[Mapping[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") == "input_image":
            parts.append(intake().url(part.get("image_url"), f"{where}.content[{j}]"))
        else:
            parts.append(text_part(_text_of([part], where)))
    return joined(parts)


def chat_messages(
    items: str | Sequence[Mapping[str, Any]],
    intake: Callable[[], ImageIntake] | None = None,
    tools: ToolTable | None = None,
) -> list[dict[str, Any]]:
    """Input items as chat messages. An assistant message and the function calls after it (and the
    reasoning item before them) are one assistant turn, as the chat API and the tape see it.
    `intake` gives the request's image intake (made on its first image); `tools` the request's tools,
    by which a namespaced `function_call` gets the flat name the model wrote it under. A `developer`
    message stays one: the renderer renders it as the model's template can (`render.roles`)."""
    images = intake or text_only_intake
    table = tools or ToolTable()
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    open_turn: dict[str, Any] | None = None  # the assistant turn later items of the same reply join
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"{where}.role must be user, system, developer or assistant", param=where)
            if role == "user":
                open_turn = None
                out.append({"role": role, "content": _content(item.get("content"), where, images)})
                continue
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                if open_turn is not None and not open_turn.get("tool_calls") and open_turn["content"] is not None:
                    open_turn["content"] += text  # several output_text messages of one reply
                    continue
                open_turn = {"role": "assistant", "content": text}
                if reasoning is not None:
                    open_turn["reasoning_content"], reasoning = reasoning, None
                out.append(open_turn)
                continue
            open_turn = None
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(arguments, str) and isinstance(call_id, str)):
                raise InvalidRequest(f"{where}: a function_call needs name, arguments and call_id", param=where)
            if open_turn is None:
                open_turn = {"role": "assistant", "content": None}
                if reasoning is not None:
                    open_turn["reasoning_content"], reasoning = reasoning, None
                out.append(open_turn)
            name = table.input_name(item.get("namespace"), name)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            open_turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}: a function_call_output needs call_id", param=where)
            result = output if isinstance(output, str) else _content(output, where, images)
            open_turn = None
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise InvalidRequest(f"{where}: input items of type {kind!r} are not supported", param=where)
    return out


def response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as a chat response format."""
    spec = (text or {}).get("format")
    return dict(spec) if isinstance(spec, Mapping) else None


# -- fields no engine here applies ------------------------------------------------------------------
# (field: (its no-op values, why it is refused)); text.verbosity and reasoning.effort are read below
_UNAPPLIED: dict[str, tuple[tuple[Any, ...], str]] = {
    "truncation": ((None, "disabled"), "prompts are never truncated: the tape records every token"),
    "background": ((None, False), "background responses are not supported"),
    "conversation": ((None,), "conversations are not stored; resend the input or use previous_response_id"),
    "prompt": ((None,), "stored prompt templates are not supported"),
    "max_tool_calls": ((None,), "the number of tool calls in a reply is not limited here"),
    "context_management": ((None, []), "context compaction is not done here: the tape records every token"),
}


def refuse_unapplied(req: ResponsesRequest) -> None:
    """Fields that would change the answer and that no engine here applies: a 400 naming the field."""
    sent = req.__dict__
    for name, (no_ops, why) in _UNAPPLIED.items():
        value = sent.get(name)
        if not any(value == v and type(value) is type(v) for v in no_ops):
            raise InvalidRequest(f"{name} is not applied by this gateway: {why}", param=name)
    verbosity = (req.text or {}).get("verbosity")
    if verbosity not in (None, "medium"):
        raise InvalidRequest(
            "text.verbosity is not applied by this gateway: no chat template reads it (send 'medium' or leave it out)",
            param="text.verbosity",
        )

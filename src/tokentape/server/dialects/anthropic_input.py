"""An Anthropic Messages request read into a chat turn: the request's fields (`MessagesRequest`, and
`CountTokensRequest` for a token count), `system` and content blocks as chat messages, tools and
`tool_choice` in chat terms, the thinking switch and effort, and the context edits accepted or refused.
The dialect that puts these together is `anthropic`."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt, StrictStr

from tokentape.errors import InvalidRequest
from tokentape.server.dialects import common
from tokentape.server.dialects.common import ChatFields, Number
from tokentape.server.dialects.images import ImageIntake, joined, text_only_intake, text_part
from tokentape.server.protocol import MAX_MESSAGES

__all__ = [
    "CountTokensRequest",
    "MessagesRequest",
    "chat_messages",
    "chat_tool_choice",
    "chat_tools",
    "check_context_edits",
    "effort_of",
    "system_prompt",
    "thinking_on",
    "thinking_shown",
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

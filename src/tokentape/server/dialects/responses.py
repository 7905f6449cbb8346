"""OpenAI Responses (`POST /v1/responses`) <-> the gateway's chat turn.

Requests: input items (messages, `function_call`, `function_call_output`, `reasoning`) become chat
messages; `instructions` the system message; flat function tools chat tools; `text.format` the
response format. `previous_response_id` names a recorded turn: its conversation (kept by
`ResponseHistory`) is put in front of the new input, so the turn extends that branch of the tape.
An agent that resends the whole history instead gets the same result: its echoed output items merge
back into the assistant message that was returned, which the session recognises.

Responses: built as the `openai` package's own `Response` and stream-event types (validated, so the
SDK parses what it expects), plus the token data chat completions carry: `prompt_token_ids`,
`token_ids`, `session_id`. With `include=["message.output_text.logprobs"]` the sampled tokens'
logprobs are where the SDK reads them: in each `output_text` part (`output[i].content[j].logprobs`)
and in each `response.output_text.delta`, as OpenAI's `{token, logprob, bytes, top_logprobs}`. A part
lists the tokens of its text; a delta that carries no text hands its tokens to the next one (a token
may end inside a character), and tokens that only made reasoning are in no part. Unstreamed, a reply
comes as one piece, so its part lists every sampled token. `output_logprobs` at the top level keeps
every sampled token (tool-call text included), as earlier versions answered.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import operator
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
import pydantic
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import Field, StrictBool, StrictInt, StrictStr

from tokentape.core.held import HeldBytes, parsed_bytes
from tokentape.core.images import has_images
from tokentape.core.messages import Message
from tokentape.engines.base import SampledToken
from tokentape.engines.remote.wire import wire_ids
from tokentape.errors import InvalidRequest, NotFound, TokentapeError
from tokentape.gateway.calls import Call, ChatCall, ChoiceDone, Event, Started, TextDelta
from tokentape.server.dialects import common
from tokentape.server.dialects.common import Caller, ChatFields, Number, chat_call, sampling_from_wire
from tokentape.server.dialects.images import ImageIntake, LazyIntake, joined, text_only_intake, text_part
from tokentape.server.dialects.wire import TokenText, named_sse
from tokentape.server.errors import OPENAI_ERRORS, ErrorShape
from tokentape.server.serving import Dialect, DialectContext

__all__ = [
    "OpenAIResponses",
    "ResponsesRequest",
    "ResponseHistory",
    "ResponseShaper",
    "chat_messages",
    "chat_tools",
    "check_event",
    "check_response",
    "response_format",
    "LOGPROBS_INCLUDE",
]

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_INPUT_ITEMS = 4096  # as many as chat messages
RESPONSES_KEPT = 100_000  # conversations kept for previous_response_id, at most
# and at most this many bytes of them (as `ResponseHistory` counts), nor more than an eighth of the budget
RESPONSES_KEPT_BYTES = 256 << 20


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
    # refused when set to anything but their no-op value (`_refuse_unapplied`)
    truncation: StrictStr | None = None
    background: StrictBool | None = None
    conversation: StrictStr | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: StrictInt | None = None
    context_management: list[Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


# -- requests --------------------------------------------------------------------------------------
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


# Tools OpenAI's servers run (hosted): no engine here runs them, so the model is not shown them (as
# vLLM's Responses server leaves every tool but functions out) and the turn goes on without them.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "tool_search",
    }
)
NAMESPACE_SEPARATOR = "__"  # a namespaced function's name as the model sees it: `{namespace}__{name}` (vLLM's)


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for `name` in `namespace` (vLLM's flat name), or `name` alone."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


@dataclass(frozen=True, slots=True)
class ToolTable:
    """A request's tools as the model is shown them: flat function tools as chat tools, the functions
    of each `namespace` tool under their flat names, hosted tools left out (`left_out`: their
    positions and types). `namespaced` maps a flat name back to (namespace, name)."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    left_out: list[tuple[int, str]] = field(default_factory=list)
    top_level: frozenset[str] = frozenset()

    def call_name(self, name: str) -> tuple[str | None, str]:
        """(namespace, name) of a sampled call's name: a flat namespaced name split back."""
        found = self.namespaced.get(name)
        return found if found is not None else (None, name)

    def input_name(self, namespace: Any, name: str) -> str:
        """The flat name of a `function_call` input item: with its `namespace`, or (where an agent
        echoed the call without it) a name only one namespace has and no flat function shares."""
        if isinstance(namespace, str) and namespace:
            return flat_name(namespace, name)
        if name in self.top_level:
            return name
        owners = [flat for flat, (_, inner) in self.namespaced.items() if inner == name]
        return owners[0] if len(owners) == 1 else name

    @property
    def note(self) -> str | None:
        """What the model was not shown, in words (None: it was shown every tool)."""
        if not self.left_out:
            return None
        listed = ", ".join(f"tools[{i}] ({kind})" for i, kind in self.left_out)
        return f"hosted tools left out of the prompt (no engine here runs them): {listed}"


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The request's tools as the chat tools the model is shown (`tool_table`)."""
    return tool_table(tools).chat or None


def tool_table(tools: Sequence[Mapping[str, Any]] | None) -> ToolTable:
    """Function tools, the functions of namespace tools (flat names), hosted tools left out; a tool
    the client runs that cannot be shown as a function (`custom`, `local_shell`, computer use) is
    refused by name."""
    table = ToolTable()
    top_level = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        where = f"tools[{i}]"
        if kind == "function":
            _check_name(tool, where)
            top_level.append(tool["name"])
            table.chat.append(common.chat_function_tool(tool, "parameters"))
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace or not isinstance(tool.get("tools"), list):
                raise InvalidRequest(f"{where}: a namespace tool needs a name and a list of tools", param=where)
            for j, inner in enumerate(tool["tools"]):
                inner_where = f"{where}.tools[{j}]"
                if not isinstance(inner, Mapping) or inner.get("type") != "function":
                    got = inner.get("type") if isinstance(inner, Mapping) else None
                    raise InvalidRequest(
                        f"{inner_where}: only function tools are supported in a namespace (got {got!r})",
                        param=inner_where,
                    )
                _check_name(inner, inner_where)
                flat = flat_name(namespace, inner["name"])
                table.namespaced[flat] = (namespace, inner["name"])
                table.chat.append(common.chat_function_tool({**inner, "name": flat}, "parameters"))
        elif kind in HOSTED_TOOLS:
            table.left_out.append((i, str(kind)))
        else:
            raise InvalidRequest(
                f"{where}: only function, namespace and hosted tools are supported (got {kind!r})", param=where
            )
    names = [t["function"]["name"] for t in table.chat]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InvalidRequest(f"tools: function names must be unique (given twice: {', '.join(twice)})", param="tools")
    return dataclasses.replace(table, top_level=frozenset(top_level))


def _check_name(tool: Mapping[str, Any], where: str) -> None:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequest(f"{where}: a function tool needs a name", param=where)


def chat_tool_choice(tool_choice: str | Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice` in chat terms; a namespaced function by its flat name."""
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice
    if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
        raise InvalidRequest(
            "tool_choice must be 'none', 'auto', 'required' or a function (hosted tools are not run here)",
            param="tool_choice",
        )
    namespace = tool_choice.get("namespace")
    name = flat_name(namespace if isinstance(namespace, str) else None, tool_choice["name"])
    return {"type": "function", "function": {"name": name}}


def response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as a chat response format."""
    spec = (text or {}).get("format")
    return dict(spec) if isinstance(spec, Mapping) else None


@dataclass(eq=False, slots=True)
class _Conversation:
    session_id: str
    messages: list[Message]
    size: int  # the bytes it is counted for: those it shares with the one it extends are counted there
    extends: str | None  # the response whose conversation it starts with (the same message objects)
    extended_by: list[str] = field(default_factory=list)


class ResponseHistory:
    """What `previous_response_id` continues: per stored response, its session and the whole
    conversation up to and including the reply (without the instructions, which are per request).
    Kept in memory, least recently stored out first, within `kept` conversations and `max_bytes`
    (and an eighth of the gateway's budget where it counts in one: `held`, kind "responses").

    A conversation is counted as its messages' JSON parse would hold (`core.held.parsed_bytes`). One
    that continues its session's last (`previous_response_id`: the same message objects, then more)
    is counted for its new messages only; when the one it continues leaves, its count passes on, so
    what stays counted is never less than what stays held."""

    def __init__(
        self, kept: int = RESPONSES_KEPT, max_bytes: int = RESPONSES_KEPT_BYTES, held: HeldBytes | None = None
    ) -> None:
        self.kept = kept
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._held = held
        self._entries: OrderedDict[str, _Conversation] = OrderedDict()
        self._latest: dict[str, str] = {}  # session -> its last stored response
        if held is not None:
            held.add("responses", lambda: self.held_bytes)

    @property
    def bound(self) -> int:
        budget = self._held.budget if self._held is not None else 0
        return min(self.max_bytes, budget // 8) if budget > 0 else self.max_bytes

    def remember(self, response_id: str, session_id: str, conversation: list[Message]) -> None:
        self._drop(response_id)
        base_id = self._latest.get(session_id)
        base = self._entries.get(base_id) if base_id is not None else None
        shared = len(base.messages) if base is not None else 0
        if base is None or shared > len(conversation) or not all(map(operator.is_, base.messages, conversation)):
            base, shared = None, 0
        size = _conversation_bytes(conversation[shared:])
        entry = _Conversation(session_id, conversation, size, base_id if base is not None else None)
        if base is not None:
            base.extended_by.append(response_id)
        self._entries[response_id] = entry
        self._latest[session_id] = response_id
        self.held_bytes += size
        bound = self.bound
        while self._entries and (len(self._entries) > self.kept or self.held_bytes > bound):
            self._drop(next(iter(self._entries)))

    def recall(self, response_id: str) -> tuple[str, list[Message]]:
        found = self._entries.get(response_id)
        if found is None:
            raise NotFound(
                f"no stored response '{response_id}' (responses created with store=false are not kept)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return found.session_id, found.messages

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self.held_bytes -= entry.size
        if self._latest.get(entry.session_id) == response_id:
            del self._latest[entry.session_id]
        for later in entry.extended_by:  # they still hold its messages: they count them now
            if (child := self._entries.get(later)) is not None and child.extends == response_id:
                child.size += entry.size
                child.extends = None
                self.held_bytes += entry.size


def _conversation_bytes(messages: list[Message]) -> int:
    try:
        return parsed_bytes(orjson.dumps(messages))
    except TypeError:  # not JSON orjson writes (never from a request): counted by its text
        return 4 * len(repr(messages))


# -- responses -------------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class _OpenItem:
    kind: Literal["reasoning", "message"]
    id: str
    index: int
    text: list[str] = field(default_factory=list)


class ResponseShaper:
    """Shapes one response: the whole object, or the stream of events that builds it."""

    def __init__(
        self,
        req: ResponsesRequest,
        *,
        session_id: str,
        prompt: Sequence[int],
        tokens: TokenText,
        show_prompt: bool = True,
    ) -> None:
        self.req = req
        self.id = _new_id("resp")
        self.created = time.time()
        self.session_id = session_id
        self.prompt = wire_ids(prompt)  # as orjson writes it fastest (the tape's IDs: their text, written once)
        self.prompt_tokens = len(prompt)
        self.prompt_field = {"prompt_token_ids": self.prompt} if show_prompt else {}
        self.tokens = tokens
        self._top = (req.top_logprobs or 0) if req.wants_logprobs else None  # None: no logprobs asked
        self._tools = req.tools or []
        self._names = tool_table(self._tools)  # a sampled call's flat name -> its namespace and name
        self._carry = ENCRYPTED_INCLUDE in (req.include or ())  # reasoning items carry their text
        self._sequence = 0
        self._items: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None
        self._message_id = _new_id("msg")
        self._reasoning_id = _new_id("rs")
        self._streamed_text: list[SampledToken] | None = None  # the message part's tokens, when streamed
        self._pending: list[SampledToken] = []  # tokens that made no text yet

    # -- the whole response --------------------------------------------------------------------------
    def _base(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": req.model,
            "status": status,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "tool_choice": req.tool_choice or "auto",
            "tools": [_echoed_tool(tool) for tool in self._tools],
            "instructions": req.instructions,
            "previous_response_id": req.previous_response_id,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "store": req.store if req.store is not None else True,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "metadata": req.metadata or {},
            "usage": None,
            "error": None,
            "incomplete_details": None,
            **self.prompt_field,
            "session_id": self.session_id,
        }

    def _logprobs(self, tokens: Sequence[SampledToken]) -> list[dict[str, Any]]:
        """OpenAI's logprob entries; empty when the request did not ask for them."""
        return [] if self._top is None else self.tokens.entries(tokens, self._top)

    def output_items(self, done: ChoiceDone) -> list[dict[str, Any]]:
        reply = done.reply
        items: list[dict[str, Any]] = []
        if reply.reasoning:
            items.append(self._reasoning(reply.reasoning))
        if reply.content:
            text_tokens = done.tokens if self._streamed_text is None else self._streamed_text
            items.append(self._message(self._part(reply.content, self._logprobs(text_tokens)), "completed"))
        for call in reply.tool_calls:
            items.append(self._function_call(call, "completed"))
        return items

    def _reasoning(self, text: str) -> dict[str, Any]:
        item = {
            "id": self._reasoning_id,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed",
        }
        if self._carry:
            item["encrypted_content"] = carried_reasoning(text)
        return item

    @staticmethod
    def _part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _message(self, part: dict[str, Any] | None, status: str) -> dict[str, Any]:
        return {
            "id": self._message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [] if part is None else [part],
        }

    def _function_call(self, call: Mapping[str, Any], status: str) -> dict[str, Any]:
        """A sampled call as a `function_call` item: a namespaced function by its own name, with
        its `namespace` (as OpenAI answers a call of a namespace tool's function)."""
        function = call["function"]
        namespace, name = self._names.call_name(function["name"])
        item = {
            "id": f"fc_{call['id'].removeprefix('call_')}",
            "type": "function_call",
            "call_id": call["id"],
            "name": name,
            "arguments": function["arguments"] if status == "completed" else "",
            "status": status,
        }
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def response(self, done: ChoiceDone) -> dict[str, Any]:
        incomplete = done.finish_reason in ("length", "abort")
        body = self._base("incomplete" if incomplete else "completed", self.output_items(done))
        if incomplete:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["completed_at"] = None if incomplete else time.time()
        body["usage"] = {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": len(done.tokens),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + len(done.tokens),
        }
        body["token_ids"] = [t.token_id for t in done.tokens]
        if self._top is not None:  # every sampled token, tool-call text included
            body["output_logprobs"] = self._logprobs(done.tokens)
        return body

    # -- the stream ----------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> Iterator[dict[str, Any]]:
        self._streamed_text = []
        base = self._base("in_progress", [])
        yield self._event("response.created", response=base)
        yield self._event("response.in_progress", response=base)

    def _close_open(self) -> Iterator[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return
        text = "".join(item.text)
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        part: dict[str, Any]
        done: dict[str, Any]
        if item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            yield self._event("response.reasoning_text.done", text=text, **where)
            yield self._event("response.content_part.done", part=part, **where)
            done = self._reasoning(text)
        else:
            assert self._streamed_text is not None
            self._streamed_text += self._pending  # what followed the last text, the end of turn token included
            self._pending = []
            logprobs = self._logprobs(self._streamed_text)
            part = self._part(text, logprobs)
            yield self._event("response.output_text.done", text=text, logprobs=logprobs, **where)
            yield self._event("response.content_part.done", part=part, **where)
            done = self._message(part, "completed")
        self._items.append(done)
        yield self._event("response.output_item.done", item=done, output_index=item.index)

    def _open_item(self, kind: Literal["reasoning", "message"]) -> Iterator[dict[str, Any]]:
        yield from self._close_open()
        index = len(self._items)
        item: dict[str, Any]
        if kind == "reasoning":
            item = {
                "id": self._reasoning_id,
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = self._message(None, "in_progress")
            part = self._part("", [])
        self._open = _OpenItem(kind, item["id"], index)
        yield self._event("response.output_item.added", item=item, output_index=index)
        yield self._event(
            "response.content_part.added", part=part, item_id=item["id"], output_index=index, content_index=0
        )

    def delta(self, event: TextDelta) -> Iterator[dict[str, Any]]:
        if event.text or not event.reasoning:  # tokens that only made reasoning are in no part
            self._pending += event.tokens
        for kind, text in (("reasoning", event.reasoning), ("message", event.text)):
            if not text:
                continue
            if self._open is None or self._open.kind != kind:
                yield from self._open_item(kind)  # type: ignore[arg-type]
            assert self._open is not None
            self._open.text.append(text)
            where = {"item_id": self._open.id, "output_index": self._open.index, "content_index": 0}
            if kind == "reasoning":
                yield self._event("response.reasoning_text.delta", delta=text, **where)
            else:
                assert self._streamed_text is not None
                tokens, self._pending = self._pending, []
                self._streamed_text += tokens
                yield self._event("response.output_text.delta", delta=text, logprobs=self._logprobs(tokens), **where)

    def closing(self, done: ChoiceDone) -> Iterator[dict[str, Any]]:
        yield from self._close_open()
        for call in done.reply.tool_calls:
            index = len(self._items)
            item = self._function_call(call, "in_progress")
            yield self._event("response.output_item.added", item=item, output_index=index)
            arguments = call["function"]["arguments"]
            where = {"item_id": item["id"], "output_index": index}
            yield self._event("response.function_call_arguments.delta", delta=arguments, **where)
            yield self._event("response.function_call_arguments.done", arguments=arguments, **where)
            finished = self._function_call(call, "completed")
            self._items.append(finished)
            yield self._event("response.output_item.done", item=finished, output_index=index)
        final = self.response(done)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=final)

    def error(self, message: str, code: str | None, param: str | None) -> dict[str, Any]:
        return self._event("error", message=message, code=code, param=param)


def _echoed_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A request's tool as the Response lists it (a function tool's optional fields filled in)."""
    if tool.get("type") == "function":
        return {"strict": None, "description": None, **tool}
    return dict(tool)


_EVENT_ADAPTER: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


def check_response(body: dict[str, Any]) -> dict[str, Any]:
    """The body checked against the `openai` package's own `Response` type, so that a shape the SDK
    would misread fails in the tests. Never on the serving path: the turn is recorded by then."""
    Response.model_validate(body)
    return body


def check_event(event: dict[str, Any]) -> dict[str, Any]:
    """One stream event checked against the `openai` package's event union (used by the tests)."""
    _EVENT_ADAPTER.validate_python(event)
    return event


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


def _refuse_unapplied(req: ResponsesRequest) -> None:
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


# -- the dialect -----------------------------------------------------------------------------------
def _responses_error_event(exc: TokentapeError) -> bytes:
    event = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": 0}
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


RESPONSES_ERRORS = ErrorShape("openai-responses", OPENAI_ERRORS.body, _responses_error_event)


class OpenAIResponses(Dialect[ResponsesRequest]):
    """OpenAI Responses: input items (or `previous_response_id` and new input) in, one assistant turn
    sampled and recorded, answered as a `Response` (or its stream events) with the token data."""

    path = "/v1/responses"
    history_field = "input"
    errors = RESPONSES_ERRORS
    request_model = ResponsesRequest

    def __init__(self, context: DialectContext, history: ResponseHistory | None = None) -> None:
        super().__init__(context)
        self.history = history or ResponseHistory(held=context.held)

    def to_call(self, req: ResponsesRequest, raw: dict[str, Any], caller: Caller) -> ChatCall:
        """The conversation `previous_response_id` continues is looked up here, once, before the
        turn: nothing after the turn is recorded can fail for it."""
        session_id = caller.session_id
        earlier: list[Message] = []
        if req.previous_response_id is not None:
            owner, earlier = self.history.recall(req.previous_response_id)
            if session_id is not None and session_id != owner:
                raise InvalidRequest(
                    f"previous_response_id belongs to session '{owner}', not '{session_id}'",
                    param="previous_response_id",
                )
            session_id = owner
        _refuse_unapplied(req)
        table = tool_table(req.tools)
        images = LazyIntake(self.context.image_intake)
        messages: list[Message] = [*earlier, *chat_messages(req.input, images, table)]
        if earlier and images.images is None and has_images(earlier):  # the continued conversation's images
            images()
        if not messages:
            raise InvalidRequest("input must not be empty", param="input")
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
        if req.top_logprobs and not req.wants_logprobs:  # as chat answers top_logprobs without logprobs
            raise InvalidRequest(f"top_logprobs requires include=['{LOGPROBS_INCLUDE}']", param="top_logprobs")
        sampling = sampling_from_wire(
            req,
            max_tokens=req.max_output_tokens,
            logprobs=req.wants_logprobs,
            top_logprobs=req.top_logprobs,
            names={"max_tokens": "max_output_tokens"},
        )
        choice, answer_format = chat_tool_choice(req.tool_choice), response_format(req.text)
        effort = (req.reasoning or {}).get("effort")
        return chat_call(
            req,
            caller,
            messages,
            sampling,
            self.tool_format,
            table.chat or None,
            choice,
            answer_format,
            template_kwargs={"reasoning_effort": effort} if isinstance(effort, str) else None,
            session_id=session_id,
            images=images.images,
            notes=(table.note,) if table.note else (),
        )

    def _shaper(self, req: ResponsesRequest, started: Started) -> ResponseShaper:
        tokens = TokenText(self.tokenizer, bool(req.return_tokens_as_token_ids))
        return ResponseShaper(
            req,
            session_id=started.session_id,
            prompt=started.prompt_token_ids,
            tokens=tokens,
            show_prompt=self.shows_prompt(req),
        )

    def _remember(self, req: ResponsesRequest, call: Call, shaper: ResponseShaper, done: ChoiceDone) -> None:
        """Keeps the conversation for a later `previous_response_id` (a dict insert: cannot fail)."""
        if req.store is not False:
            assert isinstance(call, ChatCall)
            conversation = list(call.messages[1:] if req.instructions else call.messages)
            self.history.remember(shaper.id, shaper.session_id, [*conversation, done.reply.message()])

    def respond(self, req: ResponsesRequest, call: Call, started: Started, choices: list[ChoiceDone]) -> dict[str, Any]:
        shaper = self._shaper(req, started)
        (done,) = choices
        self._remember(req, call, shaper, done)
        return shaper.response(done)

    async def stream(
        self, req: ResponsesRequest, call: Call, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        shaper = self._shaper(req, started)
        for opened in shaper.opening():
            yield named_sse(opened)
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    for shaped in shaper.delta(event):
                        yield named_sse(shaped)
                elif isinstance(event, ChoiceDone):
                    self._remember(req, call, shaper, event)
                    for shaped in shaper.closing(event):
                        yield named_sse(shaped)
        except TokentapeError as exc:  # after the first byte: an error event with its place in the sequence
            yield named_sse(shaper.error(exc.message, exc.code, exc.param))

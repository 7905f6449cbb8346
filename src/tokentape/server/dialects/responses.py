"""OpenAI Responses (`POST /v1/responses`) <-> the gateway's chat turn.

Requests: input items (messages, `function_call`, `function_call_output`, `reasoning`) become chat
messages; `instructions` the system message; flat function tools chat tools; `text.format` the
response format. `previous_response_id` names a recorded turn: its conversation (kept by
`ResponseHistory`) is put in front of the new input, so the turn extends that branch of the tape.
An agent that resends the whole history instead gets the same result: its echoed output items merge
back into the assistant message that was returned, which the session recognises.

Responses: built as the `openai` package's own `Response` and stream-event types (validated, so the
SDK parses what it expects), plus the token data chat completions carry: `prompt_token_ids`,
`token_ids`, `session_id`, and with `include=["message.output_text.logprobs"]` or `top_logprobs`
the sampled tokens' logprobs in `output_logprobs` (every sampled token, tool-call text included).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
import pydantic
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from tokentape.core.messages import Message
from tokentape.core.reply import ToolFormat
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import SampledToken
from tokentape.errors import InvalidRequest, NotFound, TokentapeError
from tokentape.gateway.calls import ChatCall, ChoiceDone, Event, Started, TextDelta
from tokentape.gateway.constraints import output_constraint
from tokentape.render.renderer import RenderOptions
from tokentape.render.tokenizer import Tokenizer
from tokentape.server.errors import OPENAI_ERRORS, ErrorShape
from tokentape.server.serving import Dialect, Origin

__all__ = [
    "OpenAIResponses",
    "ResponsesRequest",
    "ResponseHistory",
    "ResponseShaper",
    "chat_messages",
    "chat_tools",
    "response_format",
    "LOGPROBS_INCLUDE",
]

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_INPUT_ITEMS = 4096  # as many as chat messages
RESPONSES_KEPT = 100_000  # conversations kept for previous_response_id; a few KB each

Number = StrictInt | StrictFloat


class ResponsesRequest(BaseModel):
    """The fields of `responses.create` this gateway reads; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
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
    stream: StrictBool | None = None
    metadata: dict[str, str] | None = None  # OpenAI's Metadata: string values, echoed in the Response
    # what vLLM and trainers add
    seed: StrictInt | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    session_id: StrictStr | None = None
    return_tokens_as_token_ids: StrictBool | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


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


def _reasoning_text(item: Mapping[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping))


def chat_messages(items: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages. An assistant message and the function calls after it (and the
    reasoning item before them) are one assistant turn, as the chat API and the tape see it."""
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
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            open_turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}: a function_call_output needs call_id", param=where)
            text = output if isinstance(output, str) else _text_of(output, where)
            open_turn = None
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise InvalidRequest(f"{where}: input items of type {kind!r} are not supported", param=where)
    return out


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as chat tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise InvalidRequest(
                f"tools[{i}]: only function tools are supported (got {tool.get('type')!r})", param=f"tools[{i}]"
            )
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(tool_choice: str | Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice
    if tool_choice.get("type") != "function":
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or a function", param="tool_choice")
    return {"type": "function", "function": {"name": tool_choice.get("name")}}


def response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as a chat response format."""
    spec = (text or {}).get("format")
    return dict(spec) if isinstance(spec, Mapping) else None


@dataclass(slots=True)
class ResponseHistory:
    """What `previous_response_id` continues: per stored response, its session and the whole
    conversation up to and including the reply (without the instructions, which are per request).
    Kept in memory, most recent first out of RESPONSES_KEPT."""

    kept: int = RESPONSES_KEPT
    _entries: OrderedDict[str, tuple[str, list[Message]]] = field(default_factory=OrderedDict)

    def remember(self, response_id: str, session_id: str, conversation: list[Message]) -> None:
        self._entries[response_id] = (session_id, conversation)
        while len(self._entries) > self.kept:
            self._entries.popitem(last=False)

    def recall(self, response_id: str) -> tuple[str, list[Message]]:
        found = self._entries.get(response_id)
        if found is None:
            raise NotFound(
                f"no stored response '{response_id}' (responses created with store=false are not kept)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return found


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
        token_text: Any,
    ) -> None:
        self.req = req
        self.id = _new_id("resp")
        self.created = time.time()
        self.session_id = session_id
        self.prompt = prompt if isinstance(prompt, list) else list(prompt)  # the tape's arrays, for JSON
        self._token_text = token_text  # token id -> (text, bytes) as the logprobs show it
        self._tools = req.tools or []
        self._sequence = 0
        self._items: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None
        self._message_id = _new_id("msg")
        self._reasoning_id = _new_id("rs")

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
            "tools": [{"strict": None, "description": None, **tool} for tool in self._tools],
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
            "prompt_token_ids": self.prompt,
            "session_id": self.session_id,
        }

    def output_items(self, done: ChoiceDone) -> list[dict[str, Any]]:
        reply = done.reply
        items: list[dict[str, Any]] = []
        if reply.reasoning:
            items.append(
                {
                    "id": self._reasoning_id,
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": reply.reasoning}],
                    "status": "completed",
                }
            )
        if reply.content:
            items.append(self._message(reply.content, "completed"))
        for call in reply.tool_calls:
            items.append(self._function_call(call, "completed"))
        return items

    def _message(self, text: str, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "id": self._message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part] if status == "completed" else [],
        }

    @staticmethod
    def _function_call(call: Mapping[str, Any], status: str) -> dict[str, Any]:
        function = call["function"]
        return {
            "id": f"fc_{call['id'].removeprefix('call_')}",
            "type": "function_call",
            "call_id": call["id"],
            "name": function["name"],
            "arguments": function["arguments"] if status == "completed" else "",
            "status": status,
        }

    def response(self, done: ChoiceDone) -> dict[str, Any]:
        incomplete = done.finish_reason in ("length", "abort")
        body = self._base("incomplete" if incomplete else "completed", self.output_items(done))
        if incomplete:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["completed_at"] = None if incomplete else time.time()
        body["usage"] = {
            "input_tokens": len(self.prompt),
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": len(done.tokens),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(self.prompt) + len(done.tokens),
        }
        body["token_ids"] = [t.token_id for t in done.tokens]
        if self.req.wants_logprobs:
            body["output_logprobs"] = self.logprobs(done.tokens)
        return _validated(body)

    def logprobs(self, tokens: Sequence[SampledToken]) -> list[dict[str, Any]]:
        top = self.req.top_logprobs or 0
        entries = []
        for sample in tokens:
            text, raw = self._token_text(sample.token_id)
            entries.append(
                {
                    "token": text,
                    "token_id": sample.token_id,
                    "logprob": sample.logprob,
                    "bytes": raw,
                    "top_logprobs": [
                        {"token": self._token_text(t)[0], "token_id": t, "logprob": lp, "bytes": self._token_text(t)[1]}
                        for t, lp in sample.top_logprobs[:top]
                    ],
                }
            )
        return entries

    # -- the stream ----------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> Iterator[dict[str, Any]]:
        base = _validated(self._base("in_progress", []))
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
            done = {"id": item.id, "type": "reasoning", "summary": [], "content": [part], "status": "completed"}
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield self._event("response.output_text.done", text=text, logprobs=[], **where)
            yield self._event("response.content_part.done", part=part, **where)
            done = {**self._message(text, "completed")}
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
            item = self._message("", "in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open = _OpenItem(kind, item["id"], index)
        yield self._event("response.output_item.added", item=item, output_index=index)
        yield self._event(
            "response.content_part.added", part=part, item_id=item["id"], output_index=index, content_index=0
        )

    def delta(self, event: TextDelta) -> Iterator[dict[str, Any]]:
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
                yield self._event("response.output_text.delta", delta=text, logprobs=[], **where)

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


_EVENT_ADAPTER: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


def _validated(body: dict[str, Any]) -> dict[str, Any]:
    """The body checked against the `openai` package's own `Response` type: a shape the SDK would
    misread fails here, in our tests, instead of in an agent."""
    Response.model_validate(body)
    return body


def check_event(event: dict[str, Any]) -> dict[str, Any]:
    """One stream event checked against the `openai` package's event union (used by the tests)."""
    _EVENT_ADAPTER.validate_python(event)
    return event


# -- the dialect -----------------------------------------------------------------------------------
def _responses_error_event(exc: TokentapeError) -> bytes:
    event = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": 0}
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


RESPONSES_ERRORS = ErrorShape("openai-responses", OPENAI_ERRORS.body, _responses_error_event)


def _sse(event: dict[str, Any]) -> bytes:
    """Responses events are named by their type."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class OpenAIResponses(Dialect[ResponsesRequest]):
    errors = RESPONSES_ERRORS
    request_model = ResponsesRequest

    def __init__(self, tokenizer: Tokenizer, tool_format: ToolFormat, history: ResponseHistory | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.history = history or ResponseHistory()

    def session_field(self, req: ResponsesRequest) -> str | None:
        return req.session_id

    def model_field(self, req: ResponsesRequest) -> str | None:
        return req.model

    def streams(self, req: ResponsesRequest) -> bool:
        return bool(req.stream)

    def _conversation(self, req: ResponsesRequest) -> tuple[str | None, list[Message]]:
        """The session the previous response lives in (if any), and the conversation without the
        instructions: the previous response's, then this request's input."""
        owner: str | None = None
        earlier: list[Message] = []
        if req.previous_response_id is not None:
            owner, earlier = self.history.recall(req.previous_response_id)
        return owner, [*earlier, *chat_messages(req.input)]

    def call(self, req: ResponsesRequest, raw: dict[str, Any], origin: Origin) -> ChatCall:
        owner, conversation = self._conversation(req)
        session_id = origin.session_id
        if owner is not None:
            if session_id is not None and session_id != owner:
                raise InvalidRequest(
                    f"previous_response_id belongs to session '{owner}', not '{session_id}'",
                    param="previous_response_id",
                )
            session_id = owner
        if not conversation:
            raise InvalidRequest("input must not be empty", param="input")
        messages: list[Message] = list(conversation)
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20", param="top_logprobs")
        tools = chat_tools(req.tools)
        tool_choice = chat_tool_choice(req.tool_choice)
        sampling = SamplingParams(
            max_tokens=req.max_output_tokens,
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=req.top_k or 0,
            min_p=0.0 if req.min_p is None else float(req.min_p),
            seed=req.seed,
            logprobs=req.wants_logprobs,
            top_logprobs=req.top_logprobs or 0,
        )
        return ChatCall(
            messages=messages,
            sampling=sampling,
            options=RenderOptions(tools=tools),
            session_id=session_id,
            parse_tool_calls=bool(tools) and tool_choice != "none",
            request_key=origin.request_key,
            retry=origin.retry,
            trace_id=origin.trace_id,
            constraint=output_constraint(tools, tool_choice, response_format(req.text), self.tool_format),
        )

    def _shaper(self, req: ResponsesRequest, started: Started) -> ResponseShaper:
        def token_text(token_id: int) -> tuple[str, list[int]]:
            piece = self.tokenizer.token_bytes(token_id) or self.tokenizer.special_text(token_id).encode()
            text = f"token_id:{token_id}" if req.return_tokens_as_token_ids else piece.decode("utf-8", "replace")
            return text, list(piece)

        return ResponseShaper(
            req, session_id=started.session_id, prompt=started.prompt_token_ids, token_text=token_text
        )

    def _remember(self, req: ResponsesRequest, shaper: ResponseShaper, started: Started, done: ChoiceDone) -> None:
        if req.store is not False:
            _, conversation = self._conversation(req)
            self.history.remember(shaper.id, started.session_id, [*conversation, done.reply.message()])

    def respond(self, req: ResponsesRequest, started: Started, choices: list[ChoiceDone]) -> dict[str, Any]:
        shaper = self._shaper(req, started)
        (done,) = choices
        self._remember(req, shaper, started, done)
        return shaper.response(done)

    async def stream(
        self, req: ResponsesRequest, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        shaper = self._shaper(req, started)
        for opened in shaper.opening():
            yield _sse(opened)
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    for shaped in shaper.delta(event):
                        yield _sse(shaped)
                elif isinstance(event, ChoiceDone):
                    self._remember(req, shaper, started, event)
                    for shaped in shaper.closing(event):
                        yield _sse(shaped)
        except TokentapeError as exc:  # after the first byte: an error event with its place in the sequence
            yield _sse(shaper.error(exc.message, exc.code, exc.param))

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
RESPONSES_KEPT = 100_000  # conversations kept for previous_response_id; a few KB each


class ResponsesRequest(ChatFields):
    """The fields of `responses.create` this gateway reads; others are accepted and ignored."""

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


def _reasoning_text(item: Mapping[str, Any]) -> str:
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
    items: str | Sequence[Mapping[str, Any]], intake: Callable[[], ImageIntake] | None = None
) -> list[dict[str, Any]]:
    """Input items as chat messages. An assistant message and the function calls after it (and the
    reasoning item before them) are one assistant turn, as the chat API and the tape see it.
    `intake` gives the request's image intake (made on its first image)."""
    images = intake or text_only_intake
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
        out.append(common.chat_function_tool(tool, "parameters"))
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
            text_tokens = done.tokens if self._streamed_text is None else self._streamed_text
            items.append(self._message(self._part(reply.content, self._logprobs(text_tokens)), "completed"))
        for call in reply.tool_calls:
            items.append(self._function_call(call, "completed"))
        return items

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
            done = {"id": item.id, "type": "reasoning", "summary": [], "content": [part], "status": "completed"}
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
        self.history = history or ResponseHistory()

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
        images = LazyIntake(self.context.image_intake)
        messages: list[Message] = [*earlier, *chat_messages(req.input, images)]
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
        tools, choice, answer_format = (
            chat_tools(req.tools),
            chat_tool_choice(req.tool_choice),
            response_format(req.text),
        )
        return chat_call(
            req,
            caller,
            messages,
            sampling,
            self.tool_format,
            tools,
            choice,
            answer_format,
            session_id=session_id,
            images=images.images,
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

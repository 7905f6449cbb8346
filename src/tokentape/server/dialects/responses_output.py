"""A Responses turn's answer: the whole `Response` or the stream of events that builds it
(`ResponseShaper`), in the `openai` package's own shapes, with the token data chat completions carry.
The SDK's types are never imported here: the tests check these shapes against them
(tests/support/sdk_shapes.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokentape.engines.base import SampledToken
from tokentape.engines.remote.wire import wire_ids
from tokentape.gateway.calls import ChoiceDone, TextDelta
from tokentape.server.dialects.responses_input import ENCRYPTED_INCLUDE, ResponsesRequest, carried_reasoning
from tokentape.server.dialects.responses_tools import tool_table
from tokentape.server.dialects.wire import TokenText

__all__ = ["ResponseShaper"]


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

"""An Anthropic Messages turn's answer: the whole `Message` or the stream of events that builds it
(`MessageShaper`), in the `anthropic` package's own shapes, with the stop reason in Anthropic's words
and the token data. The SDK's types are never imported here: the tests check these shapes against
them (tests/support/sdk_shapes.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tokentape.core.tape import FinishReason
from tokentape.engines.base import SampledToken
from tokentape.engines.remote.wire import wire_ids
from tokentape.gateway.calls import ChoiceDone, TextDelta
from tokentape.server.dialects.anthropic_input import MessagesRequest
from tokentape.server.dialects.wire import TokenText

__all__ = ["MessageShaper", "finish_words"]


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

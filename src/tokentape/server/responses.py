"""Gateway events -> OpenAI wire objects (what the `openai` SDK parses), plus the token fields
vLLM names for `return_token_ids`: `prompt_token_ids` at the top level, `token_ids` per choice."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from tokentape.engines.base import SampledToken
from tokentape.gateway.service import ChoiceDone
from tokentape.render.tokenizer import Tokenizer

__all__ = ["WireBuilder"]


class WireBuilder:
    """Shapes one response; holds its id, creation time and model name."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        model: str,
        kind: str,
        session_id: str,
        prompt: Sequence[int],
        *,
        tokens_as_ids: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids  # return_tokens_as_token_ids: tokens spelt "token_id:N", as vLLM does
        self.model = model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.session_id = session_id
        self.prompt = prompt if isinstance(prompt, list) else list(prompt)  # the tape's arrays, for orjson

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _token_text(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._piece_text(token_id)

    def _piece_text(self, token_id: int) -> str:
        piece = self.tokenizer.token_bytes(token_id)
        return piece.decode("utf-8", "replace") if piece else self.tokenizer.special_text(token_id)

    def chat_logprobs(self, tokens: Sequence[SampledToken], top: int) -> dict[str, Any]:
        content = []
        for sample in tokens:
            entry = self._logprob_entry(sample.token_id, sample.logprob)
            entry["top_logprobs"] = [self._logprob_entry(t, lp) for t, lp in sample.top_logprobs[:top]]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _logprob_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        piece = self.tokenizer.token_bytes(token_id) or self.tokenizer.special_text(token_id).encode()
        return {"token": self._token_text(token_id), "logprob": logprob, "bytes": list(piece), "token_id": token_id}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    # -- chat ------------------------------------------------------------------------------------
    def chat_completion(self, choices: Sequence[ChoiceDone], top: int | None) -> dict[str, Any]:
        """`top`: alternatives per logprob entry; None for no logprobs."""
        return {
            **self._head("chat.completion"),
            "choices": [
                {
                    "index": c.index,
                    "message": c.reply.message(),
                    "finish_reason": c.finish_reason,
                    "logprobs": None if top is None else self.chat_logprobs(c.tokens, top),
                    "token_ids": [t.token_id for t in c.tokens],
                }
                for c in choices
            ],
            "usage": self.usage(sum(len(c.tokens) for c in choices)),
            "prompt_token_ids": self.prompt,
            "session_id": self.session_id,
        }

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
        chunk: dict[str, Any] = {
            **self._head("chat.completion.chunk"),
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": self.chat_logprobs(tokens, top) if tokens and top is not None else None,
                    "finish_reason": finish_reason,
                    "token_ids": [t.token_id for t in tokens],
                }
            ],
        }
        if first:
            chunk["prompt_token_ids"] = self.prompt
            chunk["session_id"] = self.session_id
        return chunk

    def usage_chunk(self, completion_tokens: int, obj: str) -> dict[str, Any]:
        return {**self._head(obj), "choices": [], "usage": self.usage(completion_tokens)}

    # -- completions -------------------------------------------------------------------------------
    def completion_logprobs(self, tokens: Sequence[SampledToken], top: int, offset: int) -> dict[str, Any]:
        texts = [self._token_text(t.token_id) for t in tokens]
        offsets = []
        for sample in tokens:
            offsets.append(offset)
            offset += len(self._piece_text(sample.token_id))
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{self._token_text(i): lp for i, lp in t.top_logprobs[:top]} for t in tokens],
            "text_offset": offsets,
        }

    def completion(self, choices: Sequence[ChoiceDone], top: int | None, echo: str) -> dict[str, Any]:
        return {
            **self._head("text_completion"),
            "choices": [
                {
                    "index": c.index,
                    "text": echo + c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": None if top is None else self.completion_logprobs(c.tokens, top, len(echo)),
                    "token_ids": [t.token_id for t in c.tokens],
                    "prompt_token_ids": self.prompt,  # per choice too, where vLLM and verifiers look
                }
                for c in choices
            ],
            "usage": self.usage(sum(len(c.tokens) for c in choices)),
            "prompt_token_ids": self.prompt,
            "session_id": self.session_id,
        }

    def completion_chunk(
        self,
        index: int,
        text: str,
        tokens: Sequence[SampledToken],
        top: int | None,
        finish_reason: str | None,
        first: bool,
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            **self._head("text_completion"),
            "choices": [
                {
                    "index": index,
                    "text": text,
                    "finish_reason": finish_reason,
                    "logprobs": None if top is None else self.completion_logprobs(tokens, top, 0),
                    "token_ids": [t.token_id for t in tokens],
                }
            ],
        }
        if first:
            chunk["prompt_token_ids"] = self.prompt
            chunk["session_id"] = self.session_id
        return chunk

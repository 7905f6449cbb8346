"""Special-token strings written in message text, kept as text.

A chat template renders messages to text and the text is tokenized with special tokens parsed, as
transformers' `apply_chat_template` and vLLM's chat route do: `<|image_pad|>` written in a message
would become the image placeholder token. For a vision model that is a placeholder with no image
behind it (the engine gets pads and no features; a tool output that merely quotes the string breaks
the count of placeholders against images). So a vision model's own vision tokens are never taken
from message text: each occurrence is swapped for a private marker before the template runs, and
the marker is tokenized as the string's plain text (`Tokenizer.encode_plain`). Other special tokens
keep the engines' behaviour (a `<|im_end|>` in text is the token, as vLLM and transformers make it).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from tokentape.core.messages import Message
from tokentape.render.tokenizer import Tokenizer

__all__ = ["QuotedSpecials"]

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a marker; its nonce makes it unguessable


class QuotedSpecials:
    """The special-token strings of one vocabulary that message text may only quote."""

    def __init__(self, tokenizer: Tokenizer, token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        strings = sorted({tokenizer.special_text(t) for t in token_ids} - {""}, key=len, reverse=True)
        nonce = secrets.token_hex(8)
        self._markers = {text: f"{_OPEN}{nonce}{i}{_CLOSE}" for i, text in enumerate(strings)}
        self._plain = {marker: tokenizer.encode_plain(text) for text, marker in self._markers.items()}
        self._find = re.compile("|".join(re.escape(text) for text in strings)) if strings else None
        self._split = re.compile("(" + "|".join(re.escape(m) for m in self._plain) + ")") if strings else None
        self._firsts = frozenset(text[0] for text in strings)

    # -- before the template -----------------------------------------------------------------------
    def quote_text(self, text: str) -> str:
        if self._find is None or not any(first in text for first in self._firsts):
            return text
        return self._find.sub(lambda match: self._markers[match.group(0)], text)

    def quote_message(self, message: Message) -> Message:
        """`message` with the strings in its text (content, text parts, reasoning) swapped for markers."""
        if self._find is None:
            return message
        changed: dict[str, Any] = {}
        content = message.get("content")
        if isinstance(content, str):
            quoted = self.quote_text(content)
            if quoted != content:
                changed["content"] = quoted
        elif isinstance(content, list):
            parts = [self._quote_part(part) for part in content]
            if any(a is not b for a, b in zip(parts, content, strict=True)):
                changed["content"] = parts
        for key in ("reasoning_content", "reasoning"):
            value = message.get(key)
            if isinstance(value, str) and (quoted := self.quote_text(value)) != value:
                changed[key] = quoted
        return {**message, **changed} if changed else message

    def _quote_part(self, part: Any) -> Any:
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            quoted = self.quote_text(part["text"])
            if quoted != part["text"]:
                return {**part, "text": quoted}
        return part

    # -- after the template ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token IDs of rendered `text`: special tokens parsed, each marker as its string's plain text."""
        if self._split is None or _OPEN not in text:
            return self._tokenizer.encode(text)
        tokens: list[int] = []
        for index, piece in enumerate(self._split.split(text)):
            if index % 2:
                tokens.extend(self._plain[piece])
            elif piece:
                tokens.extend(self._tokenizer.encode(piece))
        return tokens

    def unquote(self, text: str) -> str:
        """Rendered text as the messages wrote it (markers back to their strings)."""
        if self._split is None or _OPEN not in text:
            return text
        strings = {marker: text for text, marker in self._markers.items()}
        return self._split.sub(lambda match: strings[match.group(0)], text)

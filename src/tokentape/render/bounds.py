"""A lower bound on a prompt's token count from the length of its text, cheap enough to refuse a prompt
that cannot fit the context before it is rendered whole or tokenized.

One token stands for at most `span` bytes of text: the longest token of the vocabulary, in the bytes of
text it covers (SmolLM2's is a newline and 80 spaces, 81 bytes; Llama 3's 128; Qwen's 128, times 3
for its NFC normalizer, which may join three Hangul jamo of 9 bytes into one syllable of 3). A text
of `n` characters (at least `n` bytes) therefore holds at least `n // span` tokens, whatever the
tokenizer makes of it. Tokenizers that may drop text or fold a run of it into one token (WordPiece,
Unigram, added tokens that strip whitespace) have no such bound: `Tokenizer.longest_token_bytes` is
None and nothing is refused early.

Two places use it:
- before rendering, the text the template is seen to write as sent (`Verbatim`, probed once per
  renderer): each user message's content and, where the template writes every tool's whole JSON (or
  the renderer lists them itself), the tools' JSON;
- after rendering and before tokenizing, the rendered text itself, whatever the template did.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tokentape.core.messages import Message

__all__ = ["PromptTooLong", "TokenFloor", "Verbatim", "probe_verbatim"]


class PromptTooLong(Exception):
    """The prompt holds at least `floor` tokens, more than the room it was given."""

    def __init__(self, floor: int) -> None:
        super().__init__(f"the prompt holds at least {floor} tokens")
        self.floor = floor


@dataclass(frozen=True, slots=True)
class Verbatim:
    """What a template writes as it was sent: user content whole, stripped, or not known; the tools'
    whole JSON, or not known."""

    user: str  # "whole" | "stripped" | "none"
    tools: bool


_USER_PROBE = " \n tokentape probe: the user's words \n "
_TOOL_PROBE: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "tokentape_probe",
        "description": "A probe of how the template writes tools",
        "parameters": {
            "type": "object",
            "properties": {"probe_field": {"type": "string", "description": "nested probe text"}},
            "required": ["probe_field"],
        },
    },
}


def probe_verbatim(render: Callable[[Sequence[Message], Sequence[Mapping[str, Any]] | None], str]) -> Verbatim:
    """How `render` (messages, tools -> the prompt's text) writes user content and tools."""
    try:
        text = render([{"role": "user", "content": _USER_PROBE}], None)
    except Exception:  # a template that takes no such conversation: nothing is known
        text = ""
    user = "whole" if _USER_PROBE in text else "stripped" if _USER_PROBE.strip() in text else "none"
    try:
        with_tools = render([{"role": "user", "content": "Hi"}], [_TOOL_PROBE])
    except Exception:
        with_tools = ""
    # every key and value of the tool, as JSON (compact, spaced or indented): orjson's compact JSON of
    # a tool is never longer than what the template wrote
    written = (json.dumps(_TOOL_PROBE, ensure_ascii=False, indent=indent) for indent in (None, 2, 4))
    tools = any(form in with_tools for form in written) or json.dumps(_TOOL_PROBE) in with_tools
    return Verbatim(user, tools)


class TokenFloor:
    """Lower bounds on token counts for one renderer: `span` bytes at most per token."""

    def __init__(self, span: int, verbatim: Verbatim) -> None:
        self.span = span
        self.verbatim = verbatim

    def of_text(self, text: str) -> int:
        return len(text) // self.span

    def of_messages(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None) -> int:
        """At least how many tokens rendering `messages` (and `tools`) makes, from the text the
        template is known to write as sent."""
        chars = 0
        user = self.verbatim.user
        if user != "none":
            for message in messages:
                content = message.get("content")
                if message.get("role") == "user" and isinstance(content, str):
                    chars += len(content) if user == "whole" else len(content.strip())
        if tools and self.verbatim.tools:
            # less the list's commas and brackets; what orjson does not write (integers past 64 bits)
            # is not counted
            with contextlib.suppress(TypeError):
                chars += len(orjson.dumps(list(tools))) - len(tools) - 1
        return chars // self.span

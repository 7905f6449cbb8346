"""Messages -> token IDs: the first prompt of a conversation, and the bridge after a sampled reply.

The bridge is rendered in a small anchored context (the system message, the message before the
reply, the reply with a sentinel as its content) so its cost does not grow with the history; the
text after the reply's turn close is the new messages and the generation prompt, exactly as the
template renders them there. The part of the close the engine did not sample goes in front.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.bridge import REPLY_SENTINEL, remaining_close, text_after_reply, turn_close_after
from tokentape.core.messages import Message
from tokentape.render.template import ChatTemplate
from tokentape.render.tokenizer import Tokenizer

__all__ = ["Renderer", "Bridge", "RenderOptions"]

_ROOT_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """Everything besides the messages that the template sees."""

    tools: Sequence[Mapping[str, Any]] | None = None
    template_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Bridge:
    tokens: list[int]
    text: str
    template_rewrite: bool  # the template renders the earlier reply differently once new messages follow


class Renderer:
    """Pairs a chat template with the tokenizer the engine uses."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.turn_close = self._derive_turn_close()

    def _derive_turn_close(self) -> str:
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": REPLY_SENTINEL}]
        close = turn_close_after(self.template.render(probe, add_generation_prompt=False))
        followed = self.template.render([*probe, {"role": "user", "content": "Go on"}], add_generation_prompt=True)
        if not close or REPLY_SENTINEL + close not in followed:
            raise ValueError("cannot derive the turn close from this chat template")
        return close

    def prompt_text(self, messages: Sequence[Message], options: RenderOptions) -> str:
        return self.template.render(
            messages,
            add_generation_prompt=True,
            tools=options.tools,
            template_kwargs=options.template_kwargs,
        )

    def prompt(self, messages: Sequence[Message], options: RenderOptions) -> list[int]:
        """The whole conversation rendered with a generation prompt, tokenized once."""
        return self.tokenizer.encode(self.prompt_text(messages, options))

    def bridge(
        self,
        messages: Sequence[Message],
        reply_index: int,
        stop_token: int | None,
        options: RenderOptions,
    ) -> Bridge:
        """Tokens to append after the sampled reply at `messages[reply_index]`.

        `stop_token` is the end-of-turn token the engine sampled last, or None if the turn ended
        another way (then the whole turn close is bridged).
        """
        anchor = _anchor(messages, reply_index)
        new = list(messages[reply_index + 1 :])
        reply = dict(anchor[-1])
        reply["content"] = REPLY_SENTINEL
        rendered = self._render([*anchor[:-1], reply, *new], True, options)
        after = text_after_reply(rendered, self.turn_close)
        stop_text = self.tokenizer.special_text(stop_token) if stop_token is not None else None
        text = remaining_close(self.turn_close, stop_text) + after
        before = self._render(anchor, False, options)
        with_new = self._render(anchor + new, True, options)
        return Bridge(self.tokenizer.encode(text), text, template_rewrite=not with_new.startswith(before))

    def _render(self, messages: Sequence[Message], generation: bool, options: RenderOptions) -> str:
        return self.template.render(
            messages,
            add_generation_prompt=generation,
            tools=options.tools,
            template_kwargs=options.template_kwargs,
        )


def _anchor(messages: Sequence[Message], reply_index: int) -> list[Message]:
    start = max(0, reply_index - 1)
    anchor = list(messages[start : reply_index + 1])
    if start > 0 and messages[0].get("role") in _ROOT_ROLES:
        anchor.insert(0, messages[0])
    return anchor

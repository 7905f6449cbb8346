"""Chat templates rendered by transformers' own Jinja renderer (sandboxed), so text matches
`tokenizer.apply_chat_template(..., tokenize=False)` exactly."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from tokentape.errors import InvalidRequest

# transformers warns at import that PyTorch is absent; only its template renderer is used here.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from transformers.utils.chat_template_utils import render_jinja_template

__all__ = ["ChatTemplate"]


class ChatTemplate:
    """A model's chat template with the special-token strings it refers to."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render like transformers; a template that rejects the conversation raises InvalidRequest."""
        kwargs = dict(template_kwargs or {})
        kwargs.setdefault("bos_token", self.bos_token)
        kwargs.setdefault("eos_token", self.eos_token)
        try:
            result: Any = render_jinja_template(
                conversations=[[dict(m) for m in messages]],
                tools=[dict(t) for t in tools] if tools else None,
                chat_template=self.source,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"the messages could not be rendered: {exc}", param="messages") from exc
        text: str = result[0][0]
        return text

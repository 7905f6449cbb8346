"""Chat templates rendered by transformers' own Jinja renderer (sandboxed), so text matches
`tokenizer.apply_chat_template(..., tokenize=False)` exactly."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
import orjson

from tokentape.core.bounded import BoundedCache
from tokentape.errors import InvalidRequest

# transformers warns at import that PyTorch is absent; only its template renderer is used here.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from transformers.utils.chat_template_utils import (
    _alias_reasoning_fields,
    _cached_compile_jinja_template,
    render_jinja_template,
)

__all__ = ["ChatTemplate"]

# render_jinja_template's own parameters: a template kwarg of one of these names is not the template's
_RENDERER_PARAMETERS = frozenset(
    {
        "conversations",
        "tools",
        "documents",
        "chat_template",
        "return_assistant_tokens_mask",
        "continue_final_message",
        "add_generation_prompt",
        "messages",
    }
)


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
        conversation = [dict(m) for m in messages]
        tool_list: list[Any] | None = [dict(t) for t in tools] if tools else None
        try:
            if _renders_directly(conversation, tool_list, kwargs):
                return self._render_directly(conversation, tool_list, add_generation_prompt, kwargs)
            result: Any = render_jinja_template(
                conversations=[conversation],
                tools=tool_list,
                chat_template=self.source,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"the messages could not be rendered: {exc}", param="messages") from exc
        except RecursionError as exc:  # JSON nested about a thousand deep, which a request body may be
            raise InvalidRequest("the request nests too deeply to render", param="messages") from exc
        text: str = result[0][0]
        return text

    def _render_directly(
        self,
        conversation: list[dict[str, Any]],
        tools: list[Any] | None,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> str:
        """What render_jinja_template renders for inputs made of JSON's own types, without its deep copy
        of them: the copy rebuilds what the template sees out of plain types, which these already are
        (and the sandbox is immutable). A bridge renders twice a call; with four tools a render takes
        61 instead of 79 us, the check that the inputs are JSON's own types included."""
        compiled = _compiled(self.source)
        text: str = compiled.render(
            messages=_alias_reasoning_fields(conversation),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        return text


# What the remembered JSON texts of one template may hold: a tool's schema is a few hundred bytes
_JSON_MEMO_BYTES = 4 << 20
_JSON_MEMO_LARGEST = 64 << 10  # a value whose JSON is longer is written each time


@functools.lru_cache(maxsize=64)
def _compiled(source: str) -> jinja2.Template:
    """The template compiled by transformers, in an environment of its own whose `tojson` filter
    remembers what it wrote. transformers' cached compile is left as it is, so its own renders (and
    the tests that compare against them) never go through the memo."""
    environment: jinja2.Environment = _cached_compile_jinja_template(source).environment
    environment.filters["tojson"] = _JSONMemo(environment.filters["tojson"])
    environment.getattr = _keys_first(environment.getattr)  # type: ignore[method-assign, assignment]
    return environment.from_string(source)


_DICT_ATTRIBUTES = frozenset(dir(dict))


def _keys_first(getattr_: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """The sandbox's `obj.name` lookup, which tries the attribute first and takes a dict's key once
    that raises AttributeError: for a plain dict and a name that is none of dict's attributes, the key
    straight away (the same value, without raising; a quarter of a render with four tools). What has
    no such key, and everything else, goes the sandbox's own way."""

    def lookup(obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                pass
        return getattr_(obj, attribute)

    return lookup


class _JSONMemo:
    """transformers' `tojson` filter, each answer remembered by the value's JSON (orjson's bytes, the
    value's identity as JSON: key order, 1 against 1.0 and true). Templates write every tool's schema
    with it on every render, two renders a bridge: with four tools a render costs 130-165 instead of
    162-198 us warm, 451-468 instead of 500-510 cold. orjson writes NaN and infinities as null, so a value
    whose JSON holds a null is never remembered; one orjson does not take (integers past 64 bits,
    lone surrogates) is written each time, as is every scalar."""

    def __init__(self, tojson: Callable[..., str]) -> None:
        self._tojson = tojson
        self._written: BoundedCache[tuple[bytes, str], str] = BoundedCache(_JSON_MEMO_BYTES, _memo_size, max_items=1024)

    def __call__(
        self,
        value: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        if type(value) is not dict and type(value) is not list:
            return self._tojson(value, ensure_ascii, indent, separators, sort_keys)
        try:
            written = orjson.dumps(value)
        except TypeError:  # not JSON orjson writes
            return self._tojson(value, ensure_ascii, indent, separators, sort_keys)
        if b"null" in written or len(written) > _JSON_MEMO_LARGEST:
            return self._tojson(value, ensure_ascii, indent, separators, sort_keys)
        # the options by repr: 1, 1.0 and True are equal keys, and json.dumps takes them differently
        key = (written, repr((ensure_ascii, indent, separators, sort_keys)))
        text = self._written.get(key)
        if text is None:
            text = self._tojson(value, ensure_ascii, indent, separators, sort_keys)
            self._written.put(key, text)
        return text


def _memo_size(text: str) -> int:
    return 3 * len(text)  # the text and its key, about as long


def _renders_directly(conversation: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]) -> bool:
    """Whether every input is JSON's own types (what a request parses into), and no kwarg is one of
    render_jinja_template's parameters: then rendering directly renders the same text. Anything else
    (objects, tuples, a callable tool) takes transformers' whole path."""
    return (
        _is_json(conversation)
        and (tools is None or _is_json(tools))
        and _is_json(kwargs)
        and _RENDERER_PARAMETERS.isdisjoint(kwargs)
    )


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _is_json(value: Any) -> bool:
    # loops, not all() over generators: this walks every message and tool twice a bridge
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or (type(item) not in _SCALARS and not _is_json(item)):
                return False
        return True
    if kind is list:
        for item in value:  # noqa: SIM110
            if type(item) not in _SCALARS and not _is_json(item):
                return False
        return True
    return False

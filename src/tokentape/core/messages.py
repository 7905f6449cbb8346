"""Message identity: how a request's history is recognised as a path the session already recorded.

Each message gets a canonical form; a chain of hashes over the canonical forms names every prefix of
a conversation. An assistant message is canonicalised the way agents echo it back: content `None`
and `""` are equal, text is NFC-normalised and stripped (tokenizers normalise, scaffolds strip), tool
call arguments are compared as parsed JSON (spacing and key order do not matter), tool call ids and
reasoning fields are ignored (agents drop or regenerate them). The sampled tokens stay on the tape
whatever the echo looks like; this only decides *which* recorded turn an echo refers to.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson

__all__ = [
    "EMPTY_CHAIN",
    "Message",
    "canonical_message",
    "chain_of",
    "chain_step",
    "flatten_text_parts",
    "hash_chain",
    "json_or",
    "same_inputs",
    "template_inputs",
]

Message = Mapping[str, Any]

EMPTY_CHAIN = b"\x00" * 16


def json_or(text: str, fallback: Any) -> Any:
    """`text` parsed as JSON, or `fallback` where it is none. Arguments and tool calls come from
    agents and models: JSON nested deeper than the parser goes (RecursionError) is none either."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return fallback


def _canonical_arguments(arguments: Any) -> Any:
    return json_or(arguments, arguments.strip()) if isinstance(arguments, str) else arguments


def _canonical_text(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return unicodedata.normalize("NFC", content).strip()
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
        if len(parts) == len(content):
            return _canonical_text("".join(parts))
    return content


def canonical_message(message: Message) -> dict[str, Any]:
    """The parts of a message that decide whether two messages are the same turn."""
    role = message.get("role")
    if role != "assistant":
        return {k: v for k, v in message.items() if v is not None}
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        calls.append([function.get("name"), _canonical_arguments(function.get("arguments"))])
    return {"role": "assistant", "content": _canonical_text(message.get("content")), "tool_calls": calls}


def chain_step(previous: bytes, message: Message) -> bytes:
    """The chain hash after appending `message` to a prefix whose chain hash is `previous`."""
    canonical = canonical_message(message)
    try:
        payload = orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # integers past 64 bits in parsed tool arguments: json takes them
        payload = json.dumps(canonical, sort_keys=True, default=str).encode()
    return hashlib.blake2b(previous + payload, digest_size=16).digest()


def chain_of(messages: Sequence[Message]) -> bytes:
    """The chain hash of a whole message list."""
    current = EMPTY_CHAIN
    for message in messages:
        current = chain_step(current, message)
    return current


def hash_chain(messages: Sequence[Message], start: bytes = EMPTY_CHAIN) -> Iterator[bytes]:
    """Yield the chain hash of every prefix of `messages` (of length 1, 2, ...)."""
    current = start
    for message in messages:
        current = chain_step(current, message)
        yield current


def flatten_text_parts(message: Message) -> Message:
    """A message whose content is a list of text parts, with the parts joined into one string.

    Most chat templates concatenate `content` as a string; OpenAI clients may send text parts.
    """
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return message
    return {**message, "content": "".join(str(p.get("text", "")) for p in content)}


def template_inputs(
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None,
    notes: Sequence[str] = (),
) -> dict[str, Any] | None:
    """What a chat template reads besides the messages (the tools offered, `chat_template_kwargs`),
    in the form a turn records it, with `notes`: what the request sent that the model was not shown
    (e.g. hosted tools left out of the tool list), in words; None when the request gave none of them."""
    inputs: dict[str, Any] = {}
    if tools:
        inputs["tools"] = [dict(tool) for tool in tools]
    if template_kwargs:
        inputs["template_kwargs"] = dict(template_kwargs)
    if notes:
        inputs["notes"] = list(notes)
    return inputs or None


def same_inputs(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two turns' template inputs are identical as sent. Key order counts: templates write
    tools with `tojson`, which keeps it, so a reordered schema renders differently."""
    if a is b:
        return True
    return _exact_json(a or None) == _exact_json(b or None)


def _exact_json(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, default=str).encode()

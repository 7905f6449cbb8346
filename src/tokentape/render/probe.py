"""The anchor probe: whether a template renders what follows a reply the same from the anchor (the
system message and the conversation from the last user message) as from the first message.

A template can carry state across messages: DeepSeek-R1 opens its tool outputs once per
conversation, Qwen2-VL with `add_vision_id` numbers images across the whole conversation ("Picture
3:"). Such state can hang on a template kwarg or on image parts, so the verdict is learned per
distinct set of `chat_template_kwargs` and with image parts where the request has them, on
conversations where the state shows. A template the probe cannot vouch for is bridged from the
first message: the whole conversation rendered and the recorded history checked as its prefix
(exact; Jinja only, the tokenizer still sees just the new segment).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tokentape.core.images import IMAGE_PART
from tokentape.core.messages import Message
from tokentape.errors import InvalidRequest

__all__ = [
    "AnchorVerdict",
    "AnchorVerdicts",
    "ProbeOptions",
    "VERDICTS_KEPT",
    "kwargs_read",
    "probe_anchor",
    "probe_shapes",
]

# Verdicts remembered per renderer. Past this many distinct kwargs sets a new set is not probed at
# all: its bridges render from the first message (exact), so kwargs an agent varies at will cost
# neither memory nor probing time.
VERDICTS_KEPT = 64

_ROOT_ROLES = ("system", "developer")
_ROUND_ROLES = ("assistant", "tool")  # what the anchor may leave out between the user and the reply


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """What a probe conversation is rendered with (as `RenderOptions`, without importing it)."""

    tools: Sequence[Mapping[str, Any]] | None
    template_kwargs: Mapping[str, Any] | None


@dataclass(frozen=True, slots=True)
class AnchorVerdict:
    safe: bool  # bridges from the anchor equal bridges from the first message on every probe shape
    difference: str = ""  # where they differ (or why the probe could not tell)
    probed: bool = True  # False: no verdict (nothing rendered, or past the limit), bridged whole all the same


# (messages, reply index, prefix, options) -> the text a bridge after that reply renders
BridgeText = Callable[[Sequence[Message], int, list[Message], ProbeOptions], str]


def anchor(messages: Sequence[Message], reply_index: int) -> list[Message]:
    """The messages before the reply that its rendering can depend on: the system message, the last
    user message (templates place reasoning and tool-response blocks relative to it) and the round
    right before the reply (from the last assistant message on). The tool rounds between them are
    left out: an agent's pile up there, and rendering them again every call would cost as much as
    the whole history. The probe checks that this renders the same. Without a user message, or with
    anything but tool rounds between, the whole stretch is kept."""
    start = reply_index
    while start > 0 and messages[start - 1].get("role") != "user":
        start -= 1
    if start == 0:  # no user message: every message before the reply
        return list(messages[:reply_index])
    recent = reply_index
    while recent > start and messages[recent - 1].get("role") != "assistant":
        recent -= 1
    recent = max(start, recent - 1)  # the last assistant message before the reply, if after the user
    if any(m.get("role") not in _ROUND_ROLES for m in messages[start:recent]):
        recent = start
    kept = [messages[start - 1], *messages[recent:reply_index]]
    if start > 1 and messages[0].get("role") in _ROOT_ROLES:
        kept.insert(0, messages[0])
    return kept


def probe_anchor(bridge_text: BridgeText, template_kwargs: Mapping[str, Any] | None, images: bool) -> AnchorVerdict:
    """Compare, after every reply of every probe shape, the bridge rendered from the anchor with the
    one rendered from the first message. No shape the template renders: no verdict, not safe."""
    compared = 0
    for shape, options in probe_shapes(template_kwargs, images):
        for index, message in enumerate(shape):
            if message.get("role") != "assistant" or index + 1 >= len(shape):
                continue
            end = next((j for j in range(index + 1, len(shape)) if shape[j].get("role") == "assistant"), len(shape))
            messages = shape[:end]
            try:
                full = bridge_text(messages, index, list(messages[:index]), options)
            except InvalidRequest:
                continue  # a shape this template rejects cannot reach it
            compared += 1
            try:
                anchored = bridge_text(messages, index, anchor(messages, index), options)
            except InvalidRequest as exc:  # e.g. a template that checks the roles alternate
                return AnchorVerdict(False, f"the template rejects the anchor of message {index}: {exc.message}")
            if anchored != full:
                roles = ", ".join(str(m.get("role")) for m in messages)
                at = next((i for i, (a, b) in enumerate(zip(anchored, full, strict=False)) if a != b), 0)
                at = max(0, full.rfind("<", 0, at + 1))  # from the special token that differs
                return AnchorVerdict(
                    False,
                    f"after the reply at message {index} of ({roles}) the full rendering continues "
                    f"{full[at : at + 60]!r} where one from the last user message gives {anchored[at : at + 60]!r}",
                )
    if not compared:
        return AnchorVerdict(
            False, "the template rendered none of the probe conversations with these settings", probed=False
        )
    return AnchorVerdict(True)


class AnchorVerdicts:
    """Verdicts by (template kwargs, images), learned on first use; bounded (`VERDICTS_KEPT`)."""

    def __init__(self, bridge_text: BridgeText, limit: int = VERDICTS_KEPT) -> None:
        self._bridge_text = bridge_text
        self._limit = limit
        self._known: dict[tuple[bytes, bool], AnchorVerdict] = {}
        self._lock = threading.Lock()

    def get(self, template_kwargs: Mapping[str, Any] | None, images: bool) -> AnchorVerdict:
        key = (_exact(template_kwargs), images)
        with self._lock:
            known = self._known.get(key)
            if known is not None:
                return known
            if len(self._known) >= self._limit:
                return self._unprobed()
        verdict = probe_anchor(self._bridge_text, template_kwargs, images)
        with self._lock:
            if len(self._known) < self._limit:
                self._known[key] = verdict
        return verdict

    def _unprobed(self) -> AnchorVerdict:
        return AnchorVerdict(False, f"more than {self._limit} distinct template settings: not probed", probed=False)

    def known(self, template_kwargs: Mapping[str, Any] | None, images: bool) -> AnchorVerdict | None:
        """The verdict if it is learned (or will not be): None when asking would run the probe."""
        key = (_exact(template_kwargs), images)
        with self._lock:
            if key in self._known:
                return self._known[key]
            if len(self._known) >= self._limit:
                return self._unprobed()
        return None


# Names templates read that are no `chat_template_kwargs`: what every render is given, the tools,
# and template-local variables the Jinja parser cannot tell from outside ones.
_NOT_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
    | {"namespace", "range", "content", "reasoning_content", "tool_call", "first_user_message", "system_message"}
)


def kwargs_read(source: str) -> list[str]:
    """The names a template reads from outside that `chat_template_kwargs` can set, sorted."""
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateError:
        return []
    return sorted(jinja2.meta.find_undeclared_variables(parsed) - _NOT_KWARGS)


def _exact(kwargs: Mapping[str, Any] | None) -> bytes:
    """The kwargs as sent (key order counts: a template can write a kwarg with `tojson`)."""
    if not kwargs:
        return b""
    try:
        return orjson.dumps(dict(kwargs))
    except TypeError:
        return json.dumps(dict(kwargs), default=str).encode()


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


def _probe_call(word: str, index: int) -> dict[str, Any]:
    arguments = json.dumps({"word": word})
    return {"id": f"call_{index}", "type": "function", "function": {"name": "lookup", "arguments": arguments}}


def _with_image(message: Message, number: int) -> Message:
    """`message` with an image part after its text (an image counter shows from the second one)."""
    text = message.get("content") or ""
    parts = [{"type": "text", "text": text}, {"type": IMAGE_PART, IMAGE_PART: f"probe-image-{number}"}]
    return {**message, "content": parts}


def probe_shapes(template_kwargs: Mapping[str, Any] | None, images: bool) -> list[tuple[list[Message], ProbeOptions]]:
    """Conversations on which a template's state across messages shows, each with its options (the
    shapes are OpenAI messages; the renderer gives each template its own form): tool rounds, several
    tool results, reasoning, several user turns, with and without a system prompt and tools, and
    with an image in every user message and tool result when `images`."""
    system: list[Message] = [{"role": "system", "content": "Be brief."}]
    tools = ProbeOptions([_PROBE_TOOL], template_kwargs)
    plain = ProbeOptions(None, template_kwargs)
    tool_rounds: list[Message] = [
        {"role": "user", "content": "Look up cat."},
        {"role": "assistant", "content": None, "tool_calls": [_probe_call("cat", 1)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a feline"},
        {"role": "assistant", "content": "", "tool_calls": [_probe_call("dog", 2), _probe_call("cow", 3)]},
        {"role": "tool", "tool_call_id": "call_2", "content": "a canine"},
        {"role": "tool", "tool_call_id": "call_3", "content": "a bovine"},
        # a third round: the anchor of its call leaves the first round out
        {"role": "assistant", "content": None, "tool_calls": [_probe_call("hen", 6)]},
        {"role": "tool", "tool_call_id": "call_6", "content": "a bird"},
        {"role": "assistant", "content": "Cats, dogs, cows and hens."},
        {"role": "user", "content": "And a fox?"},
        {"role": "assistant", "content": None, "tool_calls": [_probe_call("fox", 4)]},
        {"role": "tool", "tool_call_id": "call_4", "content": "a vulpine"},
        {"role": "assistant", "content": "A fox is a vulpine."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "Bye."},
    ]
    reasoning: list[Message] = [
        {"role": "user", "content": "Two plus two?"},
        {"role": "assistant", "content": "Four.", "reasoning_content": "2+2=4."},
        {"role": "user", "content": "Times three?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Use the tool.",
            "tool_calls": [_probe_call("x", 5)],
        },
        {"role": "tool", "tool_call_id": "call_5", "content": "12"},
        {"role": "assistant", "content": "Twelve.", "reasoning_content": "4*3=12."},
        {"role": "user", "content": "Ok."},
        {"role": "assistant", "content": "Ok."},
    ]
    turns: list[Message] = []
    for i in range(4):
        turns += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
    shapes = [
        ([*system, *tool_rounds], tools),
        (tool_rounds, tools),
        ([*system, *reasoning], tools),
        (reasoning, tools),
        ([*system, *turns], plain),
        (turns, plain),
        (turns, tools),
    ]
    if not images:
        return shapes
    pictured: list[tuple[list[Message], ProbeOptions]] = []
    for messages, options in shapes:
        numbered = [_with_image(m, i) if m.get("role") in ("user", "tool") else m for i, m in enumerate(messages)]
        pictured.append((numbered, options))
    return pictured

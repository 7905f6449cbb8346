"""Model text -> an OpenAI assistant message: reasoning, content and tool calls, per model family.

The tape never depends on this: parsing only shapes what the agent is shown (and what it echoes
back, which `messages` recognises in canonical form). Unparseable tool-call text stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tokentape.core.messages import json_or

__all__ = [
    "ToolFormat",
    "ParsedReply",
    "ReplyStream",
    "Part",
    "parse_reply",
    "split_reasoning",
    "TOOL_START_MARKERS",
    "THINK_OPEN",
    "THINK_CLOSE",
]

ToolFormat = Literal["hermes", "qwen_xml", "glm", "llama3", "deepseek", "minimax", "none"]
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_START_MARKERS: dict[ToolFormat, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "qwen_xml": ("<tool_call>",),
    "glm": ("<tool_call>",),
    "llama3": ("<|python_tag|>",),
    "deepseek": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"),
    "minimax": ("<minimax:tool_call>",),
    "none": (),
}


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The assistant message as the OpenAI API returns it."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content if (self.content or not self.tool_calls) else None,
        }
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def split_reasoning(text: str, starts_inside: bool) -> tuple[str | None, str]:
    """(reasoning, rest). `starts_inside`: the prompt already opened the reasoning block."""
    if starts_inside:
        reasoning, closed, rest = text.partition(THINK_CLOSE)
        if not closed:  # never closed: everything so far was reasoning
            return reasoning.strip("\n"), ""
        return reasoning.strip("\n"), rest.lstrip("\n")
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        # an open block never closed (cut by max_tokens) is reasoning too, as when the prompt opened it
        reasoning, closed, rest = stripped[len(THINK_OPEN) :].partition(THINK_CLOSE)
        return reasoning.strip("\n"), rest.lstrip("\n") if closed else ""
    return None, text


def _call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _json_object(text: str) -> dict[str, Any] | None:
    value = json_or(text, None)
    return value if isinstance(value, dict) else None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_GLM = re.compile(r"<tool_call>\s*([^<\n]+?)\s*((?:<arg_key>.*?</arg_value>\s*)*)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_DEEPSEEK = re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?(.+?)(?:<｜tool▁sep｜>|\n)\s*(?:```json\s*)?(.*?)\s*(?:```\s*)?<｜tool▁call▁end｜>",
    re.DOTALL,
)


def _content_around(text: str, spans: list[tuple[int, int]]) -> str:
    """The text outside tool calls: what comes before the first call (trailing white space dropped),
    then any text between or after the calls. A stream can emit the first part as it arrives."""
    before = text[: spans[0][0]].rstrip()
    gaps = [text[end:start] for (_, end), (start, _) in zip(spans, [*spans[1:], (len(text), 0)], strict=True)]
    after = "".join(gaps).strip()
    return before + ("\n" if before and after else "") + after


def _parse_hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    calls, spans = [], []
    for match in _HERMES.finditer(text):
        obj = _json_object(match.group(1))
        if obj is None or not isinstance(obj.get("name"), str):
            return text, []  # one malformed call: show the text as it is
        calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        spans.append(match.span())
    return (_content_around(text, spans), calls) if calls else (text, [])


_QWEN_XML = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_QWEN_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _loose_value(text: str) -> Any:
    return json_or(text, text)


def _parse_qwen_xml(text: str) -> tuple[str, list[dict[str, Any]]]:
    calls, spans = [], []
    for match in _QWEN_XML.finditer(text):
        arguments = {key.strip(): _loose_value(value) for key, value in _QWEN_PARAM.findall(match.group(2))}
        calls.append(_call(match.group(1).strip(), arguments))
        spans.append(match.span())
    return (_content_around(text, spans), calls) if calls else (text, [])


def _parse_glm(text: str) -> tuple[str, list[dict[str, Any]]]:
    calls, spans = [], []
    for match in _GLM.finditer(text):
        arguments: dict[str, Any] = {}
        for key, value in _GLM_ARG.findall(match.group(2)):
            arguments[key.strip()] = _loose_value(value)
        calls.append(_call(match.group(1).strip(), arguments))
        spans.append(match.span())
    return (_content_around(text, spans), calls) if calls else (text, [])


def _parse_llama3(text: str) -> tuple[str, list[dict[str, Any]]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    obj = _json_object(body)
    if obj is None or not isinstance(obj.get("name"), str):
        return text, []
    return "", [_call(obj["name"], obj.get("parameters", obj.get("arguments", {})))]


def _parse_deepseek(text: str) -> tuple[str, list[dict[str, Any]]]:
    starts = [at for at in (text.find(m) for m in TOOL_START_MARKERS["deepseek"]) if at >= 0]
    start = min(starts, default=0)
    calls = []
    for name, arguments in _DEEPSEEK.findall(text[start:]):
        obj = _json_object(arguments)
        calls.append(_call(name.strip(), obj if obj is not None else arguments))
    if not calls:
        return text, []
    return text[:start].rstrip(), calls


_MINIMAX = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
_MINIMAX_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def _parse_minimax(text: str) -> tuple[str, list[dict[str, Any]]]:
    """MiniMax-M2: `<minimax:tool_call>` blocks of `<invoke name=...>` with `<parameter name=...>` values
    (strings as written, other values as JSON)."""
    calls, spans = [], []
    for block in _MINIMAX.finditer(text):
        for name, body in _MINIMAX_INVOKE.findall(block.group(1)):
            arguments = {key: _loose_value(value) for key, value in _MINIMAX_PARAM.findall(body)}
            calls.append(_call(name.strip(), arguments))
        spans.append(block.span())
    return (_content_around(text, spans), calls) if calls else (text, [])


_PARSERS: dict[ToolFormat, Callable[[str], tuple[str, list[dict[str, Any]]]]] = {
    "hermes": _parse_hermes,
    "qwen_xml": _parse_qwen_xml,
    "glm": _parse_glm,
    "llama3": _parse_llama3,
    "deepseek": _parse_deepseek,
    "minimax": _parse_minimax,
}


def parse_reply(text: str, tool_format: ToolFormat, *, reasoning: bool, starts_inside: bool) -> ParsedReply:
    thought: str | None = None
    if reasoning or starts_inside:
        thought, text = split_reasoning(text, starts_inside)
    parser = _PARSERS.get(tool_format)
    content, calls = parser(text) if parser is not None else (text, [])
    return ParsedReply(content, thought, calls)


Part = tuple[Literal["reasoning", "content"], str]


class ReplyStream:
    """Splits streamed text into reasoning and content deltas that add up to exactly what
    `parse_reply` gives for the whole text, however the text was cut into pieces.

    From a tool-call marker on, text is held until the end; white space before it is held too (a
    call drops it from the content). `finish` parses the whole text and emits whatever the parse
    holds beyond what was streamed: a marker that never became a call is content after all.
    """

    def __init__(self, tool_format: ToolFormat, *, reasoning: bool, starts_inside: bool) -> None:
        self._format = tool_format
        self._markers = TOOL_START_MARKERS[tool_format]
        self._reasoning = reasoning or starts_inside
        self._starts_inside = starts_inside
        self._in_reasoning = starts_inside
        self._seen_open = starts_inside
        self._held = ""
        self._in_tools = False
        self._started = False
        self._skip_newlines = starts_inside  # newlines right after a reasoning marker are not text
        self._text: list[str] = []
        self._sent: dict[str, list[str]] = {"reasoning": [], "content": []}
        self.parsed: ParsedReply | None = None  # set by `finish`

    def feed(self, text: str) -> list[Part]:
        self._text.append(text)
        out: list[Part] = []
        buffer = self._held + text
        self._held = ""
        while buffer and not self._in_tools:
            if self._skip_newlines:
                buffer = buffer.lstrip("\n")
                if not buffer:
                    return out
                self._skip_newlines = False
            if self._in_reasoning:
                at = buffer.find(THINK_CLOSE)
                if at < 0:
                    # hold back a possible start of the close marker, and newlines that may precede it
                    keep = _partial_suffix(buffer, (THINK_CLOSE,))
                    keep += len(buffer[: len(buffer) - keep]) - len(buffer[: len(buffer) - keep].rstrip("\n"))
                    self._emit(out, "reasoning", buffer[: len(buffer) - keep])
                    self._held = buffer[len(buffer) - keep :]
                    return out
                self._emit(out, "reasoning", buffer[:at].rstrip("\n"))
                buffer = buffer[at + len(THINK_CLOSE) :]
                self._in_reasoning = False
                self._skip_newlines = True
                continue
            if self._reasoning and not self._seen_open and not self._started:
                stripped = buffer.lstrip()
                if THINK_OPEN.startswith(stripped):
                    self._held = buffer
                    return out
                if stripped.startswith(THINK_OPEN):
                    self._seen_open = True
                    self._in_reasoning = True
                    self._skip_newlines = True
                    buffer = stripped[len(THINK_OPEN) :]
                    continue
            if self._format == "llama3" and not self._started:
                stripped = buffer.lstrip()
                if not stripped:
                    self._held = buffer
                    return out
                if stripped.startswith("{"):  # Llama 3 often calls with bare JSON: the whole reply
                    self._in_tools = True
                    return out
            hits = [i for i in (buffer.find(m) for m in self._markers) if i >= 0]
            if hits:
                self._emit(out, "content", buffer[: min(hits)].rstrip())
                self._in_tools = True
                return out
            keep = _partial_suffix(buffer, self._markers)
            keep += len(buffer) - keep - len(buffer[: len(buffer) - keep].rstrip())
            self._emit(out, "content", buffer[: len(buffer) - keep])
            self._held = buffer[len(buffer) - keep :]
            return out
        return out

    def _emit(self, out: list[Part], kind: Literal["reasoning", "content"], text: str) -> None:
        if text:
            self._started = self._started or kind == "content"
            self._sent[kind].append(text)
            out.append((kind, text))

    def finish(self) -> list[Part]:
        """Parse the whole text (kept in `parsed`) and emit what the parse holds beyond what was
        streamed: held text that was plain after all, or a marker that never became a call."""
        self.parsed = parse_reply(
            "".join(self._text), self._format, reasoning=self._reasoning, starts_inside=self._starts_inside
        )
        out: list[Part] = []
        for kind, whole in (("reasoning", self.parsed.reasoning or ""), ("content", self.parsed.content)):
            sent = "".join(self._sent[kind])
            if whole.startswith(sent) and len(whole) > len(sent):
                out.append((kind, whole[len(sent) :]))  # type: ignore[arg-type]
        return out


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best

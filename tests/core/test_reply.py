"""Model text -> reasoning, content and tool calls; streaming agrees with parsing the whole text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.splitting import split_at
from tokentape.core.reply import ParsedReply, ReplyStream, ToolFormat, parse_reply

CALLS: dict[ToolFormat, str] = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>',
    "qwen_xml": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n[2, 3]\n</parameter>\n"
    "</function>\n</tool_call>",
    "glm": "<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>[2, 3]"
    "</arg_value></tool_call>",
    "llama3": '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}',
    "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
    '{"a": 1, "b": [2, 3]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "minimax": '<minimax:tool_call>\n<invoke name="add">\n<parameter name="a">1</parameter>\n'
    '<parameter name="b">[2, 3]</parameter>\n</invoke>\n</minimax:tool_call>',
}


@pytest.mark.parametrize("fmt", list(CALLS))
def test_each_family_tool_call_parses(fmt: ToolFormat) -> None:
    prefix = "" if fmt == "llama3" else "Let me add. "
    reply = parse_reply(prefix + CALLS[fmt], fmt, reasoning=False, starts_inside=False)
    (call,) = reply.tool_calls
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": [2, 3]}
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert reply.content == prefix.strip()
    assert reply.message()["content"] == (prefix.strip() or None)


def test_malformed_calls_stay_text() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>'
    reply = parse_reply(text, "hermes", reasoning=False, starts_inside=False)
    assert reply.tool_calls == [] and reply.content == text


def test_reasoning_is_split_off() -> None:
    reply = parse_reply("<think>\nhmm, 2+2\n</think>\n\n4", "none", reasoning=True, starts_inside=False)
    assert (reply.reasoning, reply.content) == ("hmm, 2+2", "4")
    opened = parse_reply("still thinking", "none", reasoning=True, starts_inside=True)
    assert (opened.reasoning, opened.content) == ("still thinking", "")
    plain = parse_reply("no tags <think> here", "none", reasoning=True, starts_inside=False)
    assert (plain.reasoning, plain.content) == (None, "no tags <think> here")


words = st.text(alphabet="abc xyz\n.<>/{}", max_size=20)


def _streamed(stream: ReplyStream, pieces: list[str]) -> tuple[str, str]:
    parts = [part for piece in pieces for part in stream.feed(piece)] + stream.finish()
    return "".join(t for kind, t in parts if kind == "reasoning"), "".join(t for kind, t in parts if kind == "content")


@given(
    reasoning=st.one_of(st.none(), words),
    closed=st.booleans(),
    content=words,
    fmt=st.sampled_from(list(CALLS)),
    calls=st.integers(0, 2),
    cut_call=st.one_of(st.none(), st.integers(1, 200)),
    after=words,
    starts_inside=st.booleans(),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_streamed_deltas_add_up_to_the_parse_of_the_whole_text(
    reasoning: str | None,
    closed: bool,
    content: str,
    fmt: ToolFormat,
    calls: int,
    cut_call: int | None,
    after: str,
    starts_inside: bool,
    cuts: list[int],
) -> None:
    """Whatever the text (complete calls, a call cut by max_tokens, stray markers, text around
    them) and however it is cut into pieces, the stream carries the same reply as the parse."""
    body = content + CALLS[fmt] * calls + after
    if cut_call is not None:  # a call cut short, as max_tokens leaves it
        body = content + CALLS[fmt][: cut_call % len(CALLS[fmt])]
    if reasoning is not None:
        close = "</think>" if closed else ""
        text = (reasoning if starts_inside else f"<think>{reasoning}") + close + (body if closed else "")
    else:
        text = ("</think>" if starts_inside else "") + body
    parsed = parse_reply(text, fmt, reasoning=True, starts_inside=starts_inside)
    stream = ReplyStream(fmt, reasoning=True, starts_inside=starts_inside)
    streamed_reasoning, streamed_content = _streamed(stream, split_at(text, cuts))
    assert stream.parsed == parsed or (stream.parsed is not None and _same_but_ids(stream.parsed, parsed))
    assert streamed_reasoning == (parsed.reasoning or "")
    assert streamed_content == parsed.content


def _same_but_ids(a: ParsedReply, b: ParsedReply) -> bool:
    def strip(calls: list[dict[str, object]]) -> list[object]:
        return [call["function"] for call in calls]

    return (a.content, a.reasoning, strip(a.tool_calls)) == (b.content, b.reasoning, strip(b.tool_calls))


def test_a_marker_cut_by_max_tokens_streams_as_content() -> None:
    """The case agents hit: a reply that opens a tool call and is cut before it closes."""
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "argu'
    stream = ReplyStream("hermes", reasoning=False, starts_inside=False)
    _, content = _streamed(stream, [text[:20], text[20:]])
    assert content == text
    assert stream.parsed is not None and stream.parsed.tool_calls == [] and stream.parsed.content == text


def test_text_before_a_call_streams_without_its_trailing_white_space() -> None:
    text = "Checking.\n\n" + CALLS["hermes"]
    stream = ReplyStream("hermes", reasoning=False, starts_inside=False)
    _, content = _streamed(stream, list(text))
    assert content == "Checking."
    assert stream.parsed is not None and len(stream.parsed.tool_calls) == 1


def test_a_sampled_tool_call_nested_past_the_parser_stays_text() -> None:
    # a policy can sample JSON nested deeper than the parser goes: the reply is text, nothing raises
    from tokentape.core.messages import json_or

    deep = "[" * 5000 + "]" * 5000
    assert json_or(deep, "fallback") == "fallback"
    assert json_or('{"a": [1, 2]}', None) == {"a": [1, 2]}
    assert json_or("not json", None) is None
    assert json_or("[" * 50 + "]" * 50, None) is not None

"""Model text -> reasoning, content and tool calls; streaming agrees with parsing the whole text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.splitting import split_at
from tokentape.core.reply import ReplyStream, ToolFormat, parse_reply

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


words = st.text(alphabet="abc xyz\n.<>/", max_size=20)


@given(
    reasoning=st.one_of(st.none(), words),
    content=words,
    fmt=st.sampled_from(list(CALLS)),
    with_call=st.booleans(),
    starts_inside=st.booleans(),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_streaming_agrees_with_parsing_the_whole_text(
    reasoning: str | None, content: str, fmt: ToolFormat, with_call: bool, starts_inside: bool, cuts: list[int]
) -> None:
    if fmt == "llama3":
        content = ""  # Llama 3 calls are the whole reply
    text = content + (CALLS[fmt] if with_call else "")
    if reasoning is not None:
        text = (f"{reasoning}</think>" if starts_inside else f"<think>{reasoning}</think>") + text
    elif starts_inside:
        text = f"</think>{text}"
    stream = ReplyStream(fmt, reasoning=True, starts_inside=starts_inside)
    parts = [part for piece in split_at(text, cuts) for part in stream.feed(piece)] + stream.finish()
    streamed_reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    streamed_content = "".join(t for kind, t in parts if kind == "content")
    parsed = parse_reply(text, fmt, reasoning=True, starts_inside=starts_inside)
    assert streamed_reasoning.strip("\n") == (parsed.reasoning or "").strip("\n")
    if parsed.tool_calls:
        assert streamed_content.strip() == parsed.content.strip()
    else:
        assert streamed_content.lstrip("\n") == parsed.content.lstrip("\n")

"""A body parsed from its session's last one: the same values, types, key order and errors as orjson
parsing the whole body, whatever the client changed, wrote twice or broke; parsed only in part
where an agent appended to its history written compactly."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import MODEL_NAME
from tests.support.histories import shared_parses_unchanged
from tokentape.served import Served
from tokentape.server import reparse
from tokentape.server.reparse import Reparser

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 40}


def _tool_output(i: int) -> dict[str, Any]:
    text = "".join(f'line {i}.{j}: "quoted" \\ path\\to\tfile é ✓\n' for j in range(60))
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": text}


def _call(i: int) -> dict[str, Any]:
    arguments = json.dumps({"command": f"cat file_{i}.py"})
    call = {"id": f"call_{i}", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _body(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, **extra})


def _same(reparser: Reparser, body: bytes, key: str | None = "s", field: str = "messages") -> Any:
    """Parsed by `reparser` exactly as orjson parses the whole body: compared as orjson writes both
    (key order at every level, and 1, 1.0 and true told apart)."""
    try:
        expected = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        with pytest.raises(orjson.JSONDecodeError) as raised:
            reparser.parse(key, body, field)
        assert str(raised.value) == str(exc)
        return None
    got = reparser.parse(key, body, field)
    assert orjson.dumps(got) == orjson.dumps(expected)
    return got


def test_an_agents_growing_history_is_parsed_once_and_only_the_new_messages_after_it() -> None:
    reparser = Reparser(min_bytes=0)
    history = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    for i in range(12):
        _same(reparser, _body(history, tools=[{"type": "function"}], stream=i % 2 == 0))
        history += [_call(i), _tool_output(i)]
    assert reparser.reused == 11  # every call after the first


def test_what_a_client_changes_before_the_end_of_the_history_is_parsed_again() -> None:
    reparser = Reparser(min_bytes=0)
    history = [SYSTEM, {"role": "user", "content": "Go."}, _call(0), _tool_output(0)]
    _same(reparser, _body(history))
    edited = [*history[:2], {**_call(0), "content": "thinking"}, *history[3:], _call(1)]
    _same(reparser, _body(edited))  # an earlier message edited
    _same(reparser, _body(edited[:3]))  # the history cut short
    _same(reparser, _body(edited, model="other"))  # what comes before the history changed
    _same(reparser, b'{"model":"m", "messages":' + orjson.dumps(edited) + b"}")  # the same, written otherwise
    assert reparser.reused == 0


def test_a_history_of_the_same_length_with_other_bytes_is_parsed_again() -> None:
    reparser = Reparser(min_bytes=0)
    history = [SYSTEM, {"role": "user", "content": "Go."}]
    _same(reparser, _body(history))
    edited = [{**SYSTEM, "content": SYSTEM["content"].replace("coding", "Coding", 1)}, *history[1:], _call(0)]
    assert _same(reparser, _body(edited))["messages"][0] == edited[0]
    assert reparser.reused == 0


def test_new_elements_written_otherwise_are_not_taken_for_where_the_history_ends() -> None:
    """Two spaces before a comma: orjson's writing of the new elements ends one element early in the
    body, and a history picked up from there would lose an element."""
    reparser = Reparser(min_bytes=0)
    _same(reparser, b'{"messages":[1]}')
    _same(reparser, b'{"messages":[1  ,0,0]}')
    assert _same(reparser, b'{"messages":[1  ,0,0,9]}')["messages"] == [1, 0, 0, 9]


def test_a_body_that_writes_the_placeholder_key_itself_parses_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The placeholder key is random per process; were a client to write it after the history, its
    value would not be taken for the new elements."""
    monkeypatch.setattr(reparse, "_SENTINEL", "known")
    monkeypatch.setattr(reparse, "_PREFIX", b'{"known":[0')
    reparser = Reparser(min_bytes=0)
    _same(reparser, b'{"messages":[1]}')
    for after in (b'"known":5', b'"known":[7,8]', b'"known":[]'):
        _same(reparser, b'{"messages":[1,2],' + after + b"}")


def test_a_history_written_with_spaces_is_parsed_whole_and_looked_for_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the history ends is looked for once a session: a client writing with spaces writes so
    every time, and looking again would cost each of its bodies more than the parse."""
    looked: list[bytes] = []
    kept = reparse._kept
    monkeypatch.setattr(reparse, "_kept", lambda body, items, field: looked.append(body) or kept(body, items, field))
    reparser = Reparser(min_bytes=0)
    history = [SYSTEM, {"role": "user", "content": "Go."}]
    for i in range(4):
        _same(reparser, json.dumps({"model": "m", "messages": history}).encode())
        _same(reparser, _body(history), key="compact")
        history += [_call(i), _tool_output(i)]
    assert reparser.reused == 3  # the compact session's
    assert len(looked) == 2  # once for each session
    _same(reparser, orjson.dumps({"input": history}), key="s", field="input")  # another field, looked at anew
    assert len(looked) == 3


def test_keys_written_twice_take_their_last_value_in_their_first_place() -> None:
    reparser = Reparser(min_bytes=0)
    history = [SYSTEM, {"role": "user", "content": "Go."}]
    _same(reparser, _body(history))
    grown = orjson.dumps([*history, _call(0)])
    _same(reparser, b'{"model":"m","messages":' + grown + b',"model":"again","stream":true,"model":"last"}')
    assert reparser.reused == 1
    # the history's own key again after it: that array is the history, the first one forgotten
    again = b'{"model":"m","messages":' + grown + b',"messages":[{"role":"user","content":"other"}]}'
    _same(reparser, again)
    _same(reparser, _body([*history, _call(0), _tool_output(0)]))


def test_a_broken_body_after_a_remembered_history_raises_what_orjson_raises() -> None:
    reparser = Reparser(min_bytes=0)
    history = [SYSTEM, {"role": "user", "content": "Go."}]
    _same(reparser, _body(history))
    whole = _body([*history, _call(0)])
    for broken in (whole[:-1], whole + b"x", whole[:-2] + b",}", whole[:-30]):
        _same(reparser, broken)
    _same(reparser, _body(history)[:-1] + b"\xff}")  # not UTF-8 after the history
    _same(reparser, whole)  # and the session goes on


def test_a_history_that_is_not_the_top_level_key_is_never_taken_for_it() -> None:
    reparser = Reparser(min_bytes=0)
    history = [SYSTEM, {"role": "user", "content": "Go."}]
    nested = orjson.dumps({"model": "m", "extra": {"messages": history}, "messages": history})
    _same(reparser, nested)
    _same(reparser, orjson.dumps({"model": "m", "extra": {"messages": history}, "messages": [*history, _call(0)]}))
    escaped = b'{"model":"m","m\\u0065ssages":' + orjson.dumps(history) + b"}"
    _same(reparser, escaped)
    # the same array's bytes first under another key, after the history's key written once already
    ahead = orjson.dumps(history)
    _same(reparser, b'{"messages":0,"x":' + ahead + b',"messages":' + ahead + b"}")
    _same(reparser, b'{"messages":0,"x":' + orjson.dumps([*history, _call(0)]) + b',"messages":' + ahead + b"}")
    numbers = b'{"note":"\\"messages\\":[1,2]","messages":[1,2]}'
    _same(reparser, numbers)
    _same(reparser, b'{"note":"\\"messages\\":[1,2]","messages":[1,2,3]}')


def test_each_parse_gets_lists_and_dicts_of_its_own_at_the_top() -> None:
    reparser = Reparser(min_bytes=0)
    history = [SYSTEM, {"role": "user", "content": "Go."}]
    first = _same(reparser, _body(history))
    first["messages"].append({"role": "user", "content": "added by the caller"})
    first["model"] = "changed"
    second = _same(reparser, _body([*history, _call(0)]))
    assert second["messages"] is not first["messages"]
    assert reparser.reused == 1


def test_sessions_are_remembered_apart_and_within_a_budget() -> None:
    reparser = Reparser(max_bytes=64 << 10, min_bytes=0)
    histories = {key: [SYSTEM, {"role": "user", "content": key * 24000}] for key in "abc"}
    for _ in range(3):
        for key, history in histories.items():
            _same(reparser, _body(history), key=key)
            history.append(_call(len(history)))
    # each history is about 24 KB: two fit in 64 KB, so the least recent is forgotten each time
    assert reparser.reused == 0
    small = Reparser(min_bytes=0)
    for _ in range(3):
        for key, history in histories.items():
            _same(small, _body(history), key=key)
            history.append(_call(len(history)))
    assert small.reused == 6


def test_the_sessions_closed_lately_are_remembered_within_a_bound() -> None:
    """A closed session's bodies keep nothing, for the last `CLOSED_REMEMBERED` sessions closed."""
    reparser = Reparser(min_bytes=0)
    history = [SYSTEM, {"role": "user", "content": "Hi."}]
    keys = [f"s{i}" for i in range(reparse.CLOSED_REMEMBERED + 1)]
    for key in keys:
        reparser.forget(key)
    for key in (keys[1], keys[-1], keys[0]):  # the first closed is no longer remembered as closed
        _same(reparser, _body(history), key=key)
        _same(reparser, _body([*history, _call(2)]), key=key)
    assert reparser.reused == 1


def test_small_bodies_and_unnamed_sessions_are_parsed_whole() -> None:
    reparser = Reparser()
    history = [SYSTEM, {"role": "user", "content": "Go."}]
    for i in range(3):
        _same(reparser, _body(history))
        _same(reparser, _body(history * 200), key=None)
        history.append(_call(i))
    assert reparser.reused == 0


_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text()
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text() | st.none()},
    optional={"extra": _json, "messages": _json},
)
_keys = st.dictionaries(st.sampled_from(["model", "messages", "stream", "tools", "x", "é"]), _json, max_size=3)


@st.composite
def _steps(draw: st.DrawFn) -> list[bytes]:
    """Bodies one client sends in turn: mostly its history grown, sometimes edited, cut, written
    with spaces or escapes, with keys before and after it (the history's own among them), or broken."""
    history = draw(st.lists(_message, min_size=1, max_size=4))
    bodies = []
    for _ in range(draw(st.integers(1, 6))):
        action = draw(st.sampled_from(["grow", "grow", "grow", "edit", "cut", "broken"]))
        if action == "grow":
            history = history + draw(st.lists(_message, max_size=3))
        elif action == "edit":
            index = draw(st.integers(0, len(history) - 1))
            history = [*history[:index], draw(_message), *history[index + 1 :]]
        elif action == "cut":
            history = history[: draw(st.integers(1, len(history)))]
        head, tail = draw(_keys), draw(_keys)
        text = (
            b"{"
            + b"".join(orjson.dumps(k) + b":" + orjson.dumps(v) + b"," for k, v in head.items())
            + draw(st.sampled_from([b'"messages":', b'"messages" : ', b'"m\\u0065ssages":']))
        )
        written = draw(st.sampled_from(["orjson", "spaces", "ascii"]))
        if written == "orjson":
            text += orjson.dumps(history)
        else:
            text += json.dumps(history, ensure_ascii=written == "ascii").encode()
        text += b"".join(b"," + orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in tail.items()) + b"}"
        if action == "broken":
            text = text[: draw(st.integers(0, len(text)))] + draw(st.sampled_from([b"", b"]", b"}", b",", b"\xff"]))
        bodies.append(text)
    return bodies


@settings(max_examples=400, deadline=None)
@given(_steps())
def test_any_sequence_of_bodies_parses_as_orjson_parses_each(bodies: list[bytes]) -> None:
    reparser = Reparser(min_bytes=0)
    for body in bodies:
        _same(reparser, body)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, str, int]]:
    """Every body the routes parse, from bodies of any size: (its key, its history field, bodies
    reused so far); each parse checked against orjson's whole parse."""
    seen: list[tuple[str | None, str, int]] = []
    read = Reparser.read

    def checked(self: Reparser, key: str | None, body: bytes, field: str) -> tuple[Any, Callable[[], None]]:
        self.min_bytes = 0
        got, keep = read(self, key, body, field)
        assert orjson.dumps(got) == orjson.dumps(orjson.loads(body))
        seen.append((key, field, self.reused))
        return got, keep

    monkeypatch.setattr(Reparser, "read", checked)
    return seen


async def test_the_chat_route_parses_a_named_sessions_history_once(
    http: httpx.AsyncClient, parses: list[tuple[str | None, str, int]]
) -> None:
    """Through the real openai SDK (which writes compact JSON), on a session's base URL and with the
    header: every body after a session's first reuses the last one."""
    by_path = openai.AsyncOpenAI(base_url="http://tokentape/sessions/rp/v1", api_key="k", http_client=http)
    by_header = openai.AsyncOpenAI(
        base_url="http://tokentape/v1", api_key="k", http_client=http, default_headers={"X-Session-ID": "rp-h"}
    )
    for client in (by_path, by_header):
        await _chat(client, "Say hi.", calls=3)
    assert [key for key, _, _ in parses] == ["rp"] * 3 + ["rp-h"] * 3
    assert parses[-1][2] == 4  # two of each session's three bodies


async def test_a_finished_or_deleted_sessions_last_body_is_forgotten(
    http: httpx.AsyncClient, parses: list[tuple[str | None, str, int]]
) -> None:
    """Nothing of a session's last body stays once it is finished or deleted, and nothing of the
    bodies that follow (refused by then, as an SDK's retries are): each is parsed whole."""
    for session, method, path in (("fin", "POST", "/sessions/fin/finish"), ("del", "DELETE", "/sessions/del")):
        base_url = f"http://tokentape/sessions/{session}/v1"
        client = openai.AsyncOpenAI(base_url=base_url, api_key="k", http_client=http, max_retries=0)
        history = await _chat(client, "Say hi.", calls=2)
        reused = parses[-1][2]
        assert (await http.request(method, path)).status_code == 200
        for _ in range(2):
            with pytest.raises(openai.APIStatusError):
                await client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=3)
            assert parses[-1] == (session, "messages", reused)


async def _chat(client: openai.AsyncOpenAI, opening: str, calls: int) -> list[Any]:
    """`calls` calls of one session, each resending the history grown; the history after them."""
    history: list[Any] = [{"role": "user", "content": opening}]
    for _ in range(calls):
        reply = await client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=3)
        history += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "Again."},
        ]
    return history


async def test_the_messages_and_responses_routes_parse_a_sessions_history_once(
    built: Served, parses: list[tuple[str | None, str, int]]
) -> None:
    """Anthropic's SDK on the Messages route and openai's on Responses (its `input` list): the second
    and third bodies of each session reuse the one before."""
    app = built.app
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://tokentape") as http:
        await _messages_and_responses(http)
    assert [(key, field) for key, field, _ in parses] == [("rp-m", "messages")] * 3 + [("rp-r", "input")] * 3
    assert [reused for _, _, reused in parses] == [0, 1, 2, 2, 3, 4]


async def _messages_and_responses(http: httpx2.AsyncClient) -> None:
    """Three calls of one session through each SDK, each resending the history grown."""
    claude = anthropic.AsyncAnthropic(base_url="http://tokentape/sessions/rp-m", api_key="k", http_client=http)
    history: list[Any] = [{"role": "user", "content": "Say hi."}]
    for _ in range(3):
        message = await claude.messages.create(model=MODEL_NAME, messages=history, max_tokens=3)
        text = "".join(block.text for block in message.content if block.type == "text")
        history += [{"role": "assistant", "content": text or "."}, {"role": "user", "content": "Again."}]
    responses = openai.AsyncOpenAI(base_url="http://tokentape/sessions/rp-r/v1", api_key="k", http_client=http)
    items: list[Any] = [{"role": "user", "content": "Say hi."}]
    for _ in range(3):
        response = await responses.responses.create(model=MODEL_NAME, input=items, max_output_tokens=3)
        items += [{"role": "assistant", "content": response.output_text or "."}, {"role": "user", "content": "Again."}]


async def test_no_route_changes_a_parsed_history_that_later_bodies_share(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parsed elements of a history are shared with the session's later parses, so no route may
    change them in place: text parts, tool calls and results, content blocks and each route's own
    items (images refused here, after the body is read, by a model without vision; with one in
    tests/images/test_shared_parses.py)."""
    await shared_parses_unchanged(http, monkeypatch, MODEL_NAME, accepted=(200, 400))

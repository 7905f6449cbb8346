"""Bad input: every case gets an OpenAI error object with the right status, and changes nothing."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.conftest import MODEL_NAME
from tokentape.server.bodies import MAX_DEPTH

GOOD = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
LONG_TEXT = "word " * 3000  # over the 1024-token context the test engine is given


def _with(**changes: Any) -> dict[str, Any]:
    body = {**GOOD, **changes}
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()


def _nested(lists: int, body: dict[str, Any] = GOOD) -> bytes:
    """`body` with a template kwarg that is `lists` arrays deep (the body two levels above them)."""
    return orjson.dumps(body)[:-1] + b',"chat_template_kwargs":{"x":' + b"[" * lists + b"]" * lists + b"}}"


BAD_BODIES: list[tuple[str, bytes | dict[str, Any] | list[Any], int, str | None]] = [
    ("malformed json", b'{"model": "x", "messages": [', 400, None),
    ("empty body", b"", 400, None),
    ("not utf-8", b"\xff\xfe{}", 400, None),
    ("lone surrogate", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("array body", [GOOD], 400, None),
    ("string body", b'"hello"', 400, None),
    ("number body", b"42", 400, None),
    ("missing messages", _with(messages=_DROP), 400, "messages"),
    ("empty messages", _with(messages=[]), 400, "messages"),
    ("messages not a list", _with(messages="Hi"), 400, "messages"),
    ("message without role", _with(messages=[{"content": "Hi"}]), 400, "messages.0.role"),
    ("unknown role", _with(messages=[{"role": "robot", "content": "Hi"}]), 400, "messages.0.role"),
    ("content is a number", _with(messages=[{"role": "user", "content": 5}]), 400, None),
    ("missing model", _with(model=_DROP), 400, "model"),
    ("temperature is a string", _with(temperature="hot"), 400, None),
    ("n is a string", _with(n="2"), 400, None),
    ("max_tokens is fractional", _with(max_tokens=1.5), 400, None),
    ("stream is a string", _with(stream="yes"), 400, None),
    ("stop is a number", _with(stop=5), 400, None),
    ("temperature too high", _with(temperature=3), 400, "temperature"),
    ("top_p zero", _with(top_p=0), 400, "top_p"),
    ("n zero", _with(n=0), 400, "n"),
    ("n too large", _with(n=100), 400, "n"),
    ("max_tokens zero", _with(max_tokens=0), 400, "max_tokens"),
    ("max_completion_tokens negative", _with(max_completion_tokens=-5), 400, "max_completion_tokens"),
    ("top_logprobs too large", _with(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("too many stop strings", _with(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("seed too large", _with(seed=2**70), 400, "seed"),
    ("unknown rewrite policy", _with(rewrite_policy="yolo"), 400, "rewrite_policy"),
    ("bad session id", _with(session_id="../etc"), 400, "session_id"),
    ("prompt longer than the context", _with(messages=[{"role": "user", "content": LONG_TEXT}]), 400, "messages"),
    ("max_tokens beyond the context", _with(max_tokens=5000), 400, "max_tokens"),
    ("unknown model", _with(model="gpt-4o"), 404, "model"),
    # JSON that orjson parses (it goes to 1,024 levels) but that recursive steps could not walk
    ("nested a thousand deep", _nested(1000), 400, None),
    ("nested one level past the bound", _nested(MAX_DEPTH - 1), 400, None),
    # the model is checked before the body is walked or validated: refusing it costs the parse alone
    ("unknown model, nested past the bound", _nested(1000, _with(model="gpt-4o")), 404, "model"),
    ("unknown model, an invalid field", _with(model="gpt-4o", n=100), 404, "model"),
]


async def _snapshot(http: httpx.AsyncClient) -> tuple[Any, Any]:
    sessions = (await http.get("/sessions")).json()
    export = (await http.get("/sessions/s/export")).json()
    return sessions, export


@pytest.mark.parametrize(("name", "body", "status", "param"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
async def test_bad_requests_get_openai_errors_and_change_nothing(
    http: httpx.AsyncClient, name: str, body: Any, status: int, param: str | None
) -> None:
    assert (await http.post("/sessions/s/v1/chat/completions", json=GOOD)).status_code == 200
    before = await _snapshot(http)
    for url in ("/sessions/s/v1/chat/completions", "/v1/chat/completions"):
        if isinstance(body, bytes):
            response = await http.post(url, content=body, headers={"content-type": "application/json"})
        else:
            response = await http.post(url, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]
        assert error["type"] == "invalid_request_error"  # every case here is a 400 or a 404
        if param is not None:
            assert error["param"] == param
    assert await _snapshot(http) == before
    assert (await http.get("/health")).json()["status"] == "ok"


async def test_a_model_name_of_megabytes_is_refused_without_being_echoed(http: httpx.AsyncClient) -> None:
    name = "<|im_end|>" + "m" * (10 << 20)
    for url, body in [
        ("/v1/chat/completions", _with(model=name)),
        ("/v1/completions", {"model": name, "prompt": "hi"}),
        ("/v1/messages", {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ]:
        response = await http.post(url, json=body)
        assert response.status_code == 404, response.text[:300]
        assert len(response.content) < 1024
    assert (await http.get("/sessions")).json()["data"] == []


async def test_completion_errors_use_the_same_shape(http: httpx.AsyncClient) -> None:
    cases = [
        ({"model": MODEL_NAME, "prompt": [1, 2, 999999]}, "prompt"),
        ({"model": MODEL_NAME, "prompt": ""}, "prompt"),
        ({"model": MODEL_NAME, "prompt": ["a", "b"]}, "prompt"),
        ({"model": MODEL_NAME, "prompt": "hi", "logprobs": 9}, "logprobs"),
        ({"model": MODEL_NAME}, "prompt"),
    ]
    for body, param in cases:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param
    assert (await http.get("/sessions")).json()["data"] == []


async def test_the_sdk_raises_its_own_error_classes(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=3)
    assert bad.value.body is not None and bad.value.code is not None
    with pytest.raises(openai.NotFoundError) as missing:
        await sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"


async def test_unknown_routes_methods_and_sessions_are_openai_errors(http: httpx.AsyncClient) -> None:
    for method, url, status in [
        ("GET", "/v1/nothing", 404),
        ("GET", "/v1/chat/completions", 405),
        ("GET", "/sessions/missing", 404),
        ("GET", "/sessions/missing/export", 404),
        ("DELETE", "/sessions/missing", 404),
    ]:
        response = await http.request(method, url)
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_a_header_and_a_body_field_naming_different_sessions_are_rejected(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json={**GOOD, "session_id": "b"}, headers={"X-Session-ID": "a"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "session_id"
    assert (await http.get("/sessions")).json()["data"] == []


async def test_the_base_url_names_the_session_and_a_header_is_kept_as_the_trace_id(http: httpx.AsyncClient) -> None:
    """Agent harnesses send their own trace id in X-Session-ID; the base URL still decides."""
    response = await http.post("/sessions/a/v1/chat/completions", json=GOOD, headers={"X-Session-ID": "trace-7"})
    assert response.status_code == 200 and response.json()["session_id"] == "a"
    assert [s["session_id"] for s in (await http.get("/sessions")).json()["data"]] == ["a"]
    (branch,) = (await http.get("/sessions/a/export")).json()["branches"]
    assert branch["trace_ids"] == ["trace-7"]


async def test_a_body_as_deep_as_the_bound_is_served(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", content=_nested(MAX_DEPTH - 2))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("depth", [100, 900, 960, 1000, 5000])
async def test_tool_call_arguments_of_any_depth_get_an_answer_not_a_server_error(
    http: httpx.AsyncClient, depth: int
) -> None:
    # arguments are JSON text inside a string: the body's bound does not see them, the parsers must
    arguments = "[" * depth + "]" * depth
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a", "content": "ok"},
    ]
    response = await http.post("/v1/chat/completions", json={**GOOD, "messages": messages})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["type"] == "invalid_request_error"

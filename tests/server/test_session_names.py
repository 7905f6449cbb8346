"""Session ids are checked once, strictly, wherever they enter (base URL, X-Session-ID, body field,
POST /sessions, the session routes): a bad one is a 400 in the OpenAI shape and never reaches the
engine. The base URL's session wins over a header or body name, which is kept as a trace id."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tokentape.gateway.service import Gateway

GOOD = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}

# as they appear in a URL path: decoded by the server before any check
BAD_IN_PATH = [
    "abc%0A",  # a trailing newline: a `$`-anchored pattern lets it through
    "abc%0D%0Ax",
    "a%2Fb",
    "a/b",
    "%2e%2e",  # a literal ".." is resolved away by the client before it is sent
    "a%00b",
    "-leading-dash",
    "caf%C3%A9",
    "x" * 129,
    "a%20b",
]
BAD_VALUES = ["abc\n", "yy\n", "..", "../etc", "a/b", "a b", "x" * 129, "-x", "\u00e9"]


async def _unchanged(http: httpx.AsyncClient, gateway: Gateway, calls: int) -> None:
    assert gateway.engine_calls == calls  # nothing reached the engine
    assert (await http.get("/sessions")).json()["data"] == []


def _assert_invalid_id(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (
        "session_id",
        "invalid_session_id",
        "invalid_request_error",
    )


@pytest.mark.parametrize("raw", BAD_IN_PATH)
async def test_a_bad_session_id_in_the_base_url_is_a_400(http: httpx.AsyncClient, gateway: Gateway, raw: str) -> None:
    calls = gateway.engine_calls
    for route in ("chat/completions", "completions"):
        body = GOOD if route.startswith("chat") else {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
        _assert_invalid_id(await http.post(f"/sessions/{raw}/v1/{route}", json=body))
    await _unchanged(http, gateway, calls)


@pytest.mark.parametrize("value", BAD_VALUES)
async def test_a_bad_session_id_in_the_body_or_at_creation_is_a_400(
    http: httpx.AsyncClient, gateway: Gateway, value: str
) -> None:
    calls = gateway.engine_calls
    _assert_invalid_id(await http.post("/v1/chat/completions", json={**GOOD, "session_id": value}))
    _assert_invalid_id(await http.post("/sessions/ok/v1/chat/completions", json={**GOOD, "session_id": value}))
    _assert_invalid_id(await http.post("/sessions", json={"session_id": value}))
    await _unchanged(http, gateway, calls)


@pytest.mark.parametrize("value", ["..", "../etc", "a/b", "a b", "x" * 129, "-x"])
async def test_a_bad_session_id_in_the_header_is_a_400(http: httpx.AsyncClient, gateway: Gateway, value: str) -> None:
    calls = gateway.engine_calls
    _assert_invalid_id(await http.post("/v1/chat/completions", json=GOOD, headers={"X-Session-ID": value}))
    _assert_invalid_id(await http.post("/sessions/ok/v1/chat/completions", json=GOOD, headers={"X-Session-ID": value}))
    await _unchanged(http, gateway, calls)


@pytest.mark.parametrize("raw", ["abc%0A", "%2e%2e", "a%20b"])
async def test_session_routes_reject_a_bad_id_instead_of_looking_it_up(http: httpx.AsyncClient, raw: str) -> None:
    for method, url in [
        ("GET", f"/sessions/{raw}"),
        ("GET", f"/sessions/{raw}/export"),
        ("POST", f"/sessions/{raw}/finish"),
        ("DELETE", f"/sessions/{raw}"),
    ]:
        _assert_invalid_id(await http.request(method, url))


async def test_the_base_url_session_wins_and_the_other_name_is_kept_as_a_trace_id(http: httpx.AsyncClient) -> None:
    by_header = await http.post("/sessions/episode/v1/chat/completions", json=GOOD, headers={"X-Session-ID": "eval-7"})
    by_body = await http.post("/sessions/episode/v1/chat/completions", json={**GOOD, "session_id": "row-3"})
    same = await http.post("/sessions/episode/v1/chat/completions", json=GOOD, headers={"X-Session-ID": "episode"})
    for response in (by_header, by_body, same):
        assert response.status_code == 200, response.text
        assert response.headers["x-session-id"] == "episode" and response.json()["session_id"] == "episode"
    assert (await http.get("/sessions/eval-7")).status_code == 404
    assert (await http.get("/sessions/row-3")).status_code == 404
    branches = (await http.get("/sessions/episode/export")).json()["branches"]
    assert sorted(str(b["trace_ids"]) for b in branches) == sorted(["['eval-7']", "['row-3']", "[None]"])

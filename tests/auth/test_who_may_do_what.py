"""Every route, every kind of key: a session key reaches its own session's generation routes and
nothing else; no key or a wrong one gets 401; a trainer key gets everything. Each refusal is in the
dialect's error shape and leaves the store as it was."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.auth.walk import MODEL, TRAINER, expected, routes, snapshot, spoiled, walk
from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer
from tokentape.served import ServeSpec, SpecError
from tokentape.server.middleware import GuardSettings

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
T = {"authorization": f"Bearer {TRAINER}"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
async def served(
    engine: LlamaCppEngine, renderer: Renderer
) -> AsyncIterator[tuple[Any, httpx.AsyncClient, dict[str, str]]]:
    """An app with a trainer key, and sessions ep-a, ep-b (one turn each) and ep-t, with their keys."""
    app = build(engine, renderer, model=MODEL, api_keys=(TRAINER, "second-trainer-key")).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        keys = {}
        for name in ("ep-a", "ep-b", "ep-t"):
            created = await http.post("/sessions", json={"session_id": name}, headers=T)
            assert created.status_code == 201, created.text
            keys[name] = created.json()["api_key"]
            assert created.json()["base_url"] == f"http://t/sessions/{name}/v1"
            turn = await http.post(f"/sessions/{name}/v1/chat/completions", json=CHAT, headers=bearer(keys[name]))
            assert turn.status_code == 200, turn.text
        yield app, http, keys


async def test_every_route_with_every_kind_of_key(served: tuple[Any, httpx.AsyncClient, dict[str, str]]) -> None:
    app, http, keys = served
    forged = f"tts.ep-a.{secrets.token_urlsafe(32)}"  # the right shape and session, a wrong secret
    headers = {
        "none": {},
        "wrong": bearer(forged),
        "wrong-shape": {"x-api-key": "not-a-key"},
        "own": bearer(keys["ep-a"]),
        "other": {"x-api-key": keys["ep-b"]},  # the anthropic SDK's header
        "trainer": T,
    }
    result = await walk(
        app,
        http,
        headers,
        lambda kind: "ep-t" if kind == "trainer" else "ep-a",
        key_sessions={"own": "ep-a", "other": "ep-b"},
    )
    assert result.problems == []
    every = routes(app)
    assert len(every) >= 40 and ("POST", "/sessions/{session_id}/reward") in every and ("GET", "/metrics") in every
    own = result.reached("own")
    # what the agent reached, spelled out: generation in every dialect, tokens, models, health
    assert "POST /v1/messages" in own and "POST /sessions/{session_id}/inference/v1/generate" in own
    assert not [route for route in own if "reward" in route or "admin" in route or "export" in route]
    assert result.reached("none") == ["GET /health"]
    assert len(result.reached("trainer")) == len(every)
    for text in (keys["ep-a"], keys["ep-b"]):  # a key is never echoed after its creation
        for path in ("/sessions/ep-a", "/sessions", "/export", "/sessions/ep-a/export"):
            assert text not in (await http.get(path, headers=T)).text


async def test_a_key_stops_working_when_its_session_is_finished_or_deleted(
    served: tuple[Any, httpx.AsyncClient, dict[str, str]],
) -> None:
    _, http, keys = served
    assert (await http.post("/sessions/ep-a/finish", headers=T)).status_code == 200
    for path in ("/v1/chat/completions", "/sessions/ep-a/v1/chat/completions"):
        refused = await http.post(path, json=CHAT, headers=bearer(keys["ep-a"]))
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_finished"
    message = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    refused = await http.post("/v1/messages", json=message, headers={"x-api-key": keys["ep-a"]})
    assert refused.status_code == 409 and refused.json()["type"] == "error"
    assert (await http.delete("/sessions/ep-b", headers=T)).status_code == 200
    refused = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(keys["ep-b"]))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_deleted"
    # the session's row went with the key: a wrong secret for it is still just unknown
    assert (
        await http.post("/v1/chat/completions", json=CHAT, headers=bearer(spoiled(keys["ep-b"])))
    ).status_code == 401


async def test_at_the_root_a_header_or_body_naming_another_session_is_refused(
    served: tuple[Any, httpx.AsyncClient, dict[str, str]],
) -> None:
    _, http, keys = served
    before = await snapshot(http)
    key = bearer(keys["ep-a"])
    cases = [
        ({**key, "x-session-id": "ep-b"}, CHAT),
        (key, {**CHAT, "session_id": "ep-b"}),
        (key, {**CHAT, "session\\u005fid": "ep-b"}),  # spelled with an escape: parsed, still refused
        (key, {**CHAT, "session_id": "ep-new"}),
    ]
    for headers, body in cases:
        content = httpx.Request("POST", "/", json=body).content.replace(b"\\\\u005f", b"\\u005f")
        response = await http.post(
            "/v1/chat/completions", content=content, headers={**headers, "content-type": "application/json"}
        )
        assert response.status_code == 403, (headers, body, response.text)
        assert response.json()["error"]["code"] == "session_key_forbidden"
    assert await snapshot(http) == before
    # naming its own session is fine; under its base URL a differing name is the client's trace id
    ok = await http.post("/v1/chat/completions", json={**CHAT, "session_id": "ep-a"}, headers=key)
    assert ok.status_code == 200 and ok.headers["x-session-id"] == "ep-a"
    traced = await http.post("/sessions/ep-a/v1/chat/completions", json=CHAT, headers={**key, "x-session-id": "t-1"})
    assert traced.status_code == 200 and traced.headers["x-session-id"] == "ep-a"


async def test_open_mode_stays_open_and_required_mode_needs_a_session_key(
    engine: LlamaCppEngine, renderer: Renderer
) -> None:
    app = build(engine, renderer, model=MODEL).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        # no key, or the placeholder key SDKs need: everything as before keys existed
        for headers in ({}, bearer("unused")):
            assert (
                await http.post("/sessions/open-1/v1/chat/completions", json=CHAT, headers=headers)
            ).status_code == 200
            assert (await http.post("/sessions/open-1/reward", json={"reward": 1}, headers=headers)).status_code == 200
        created = (await http.post("/sessions", json={"session_id": "open-2"})).json()
        agent = bearer(created["api_key"])  # an agent handed its key is held to it here too
        assert (await http.post("/v1/chat/completions", json=CHAT, headers=agent)).headers["x-session-id"] == "open-2"
        assert (await http.post("/sessions/open-2/reward", json={"reward": 1}, headers=agent)).status_code == 403
    # required session keys with no trainer key: anyone could create sessions, and so their keys
    with pytest.raises(ValueError, match="needs a trainer key"):
        GuardSettings(require_session_keys=True)
    with pytest.raises(SpecError, match="needs a trainer key"):
        ServeSpec(session_keys="required")
    app = build(engine, renderer, model=MODEL, api_keys=(TRAINER,), session_keys="required").app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        assert (await http.post("/sessions/req-1/v1/chat/completions", json=CHAT)).status_code == 401
        created = (await http.post("/sessions", json={"session_id": "req-2"}, headers=T)).json()
        assert (
            await http.post("/v1/completions", json=expected_completion(), headers=bearer(created["api_key"]))
        ).status_code == 200
        refused = await http.post("/v1/chat/completions", json=CHAT, headers=T)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "session_key_required"


def expected_completion() -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1}


def test_the_walk_oracle_is_not_vacuous() -> None:
    assert expected("own", "/sessions/{session_id}/reward") == {403}
    assert expected("other", "/sessions/{session_id}/v1/chat/completions") == {403}
    assert expected("other", "/v1/chat/completions") == {200}


def test_every_dialect_is_a_generation_route_of_the_policy() -> None:
    """A dialect added to the registry must be named in the policy (else session keys get 403 there)."""
    from tokentape.server.auth import GENERATION_ROUTES
    from tokentape.server.dialects.registry import PATHS

    assert set(PATHS) == GENERATION_ROUTES

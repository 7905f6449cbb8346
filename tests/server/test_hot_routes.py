"""The generation routes are answered by the lean ASGI path, behind the same guard and with the same
error shapes as FastAPI's routes, which stay in the OpenAPI schema."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer
from tokentape.served import Served
from tokentape.server import hot_routes

BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the lean path answered."""
    seen: list[str] = []
    real = hot_routes.HotRoutes._answer

    async def spy(self: hot_routes.HotRoutes, scope: dict[str, object], *args: object) -> None:
        seen.append(str(scope["path"]))
        await real(self, scope, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(hot_routes.HotRoutes, "_answer", spy)
    return seen


async def test_chat_and_completions_take_the_lean_path_in_and_out_of_sessions(built: Served, served: list[str]) -> None:
    app = built.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        named = await http.post("/sessions/lean-1/v1/chat/completions", json=BODY)
        assert named.status_code == 200 and named.json()["session_id"] == "lean-1"
        unnamed = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
        assert unnamed.status_code == 200
        bad = await http.post("/sessions/not%20valid/v1/chat/completions", json=BODY)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_session_id"
        malformed = await http.post("/v1/chat/completions", content=b'{"model": ')
        assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
        assert (await http.post("/sessions//v1/chat/completions", json=BODY)).status_code == 404
        assert (await http.get("/v1/chat/completions")).status_code in (404, 405)
        schema = (await http.get("/openapi.json")).json()["paths"]
        assert "/v1/chat/completions" in schema and "/sessions/{session_id}/v1/chat/completions" in schema
    assert served == [
        "/sessions/lean-1/v1/chat/completions",
        "/v1/completions",
        "/sessions/not valid/v1/chat/completions",
        "/v1/chat/completions",
    ]


async def test_the_guard_runs_before_the_lean_path(
    engine: LlamaCppEngine, renderer: Renderer, served: list[str]
) -> None:
    app = build(engine, renderer, api_keys=("k",), max_body_bytes=1000).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 401
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
        headers = {"authorization": "Bearer k"}
        assert (await http.post("/v1/chat/completions", json=big, headers=headers)).status_code == 413
        assert (await http.post("/v1/chat/completions", json=BODY, headers=headers)).status_code == 200
    assert served == ["/v1/chat/completions"]


async def test_the_other_dialects_take_the_lean_path_with_their_own_error_shapes(
    built: Served, served: list[str]
) -> None:
    app = built.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        response = await http.post(
            "/sessions/lean-r/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2}
        )
        assert response.status_code == 200 and response.json()["object"] == "response"
        message = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        response = await http.post("/sessions/lean-m/v1/messages", json=message)
        assert response.status_code == 200 and response.json()["type"] == "message"
        response = await http.post(
            "/inference/v1/generate",
            json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0}},
        )
        assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) == 2
        malformed = await http.post("/v1/messages", content=b'{"model": ')
        assert malformed.status_code == 400 and malformed.json()["type"] == "error"  # Anthropic's shape
        assert malformed.json()["error"]["type"] == "invalid_request_error"
        tapes = (await http.get("/sessions/lean-m")).json()
        assert tapes["session_id"] == "lean-m"
    assert served == [
        "/sessions/lean-r/v1/responses",
        "/sessions/lean-m/v1/messages",
        "/inference/v1/generate",
        "/v1/messages",
    ]

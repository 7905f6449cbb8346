"""One registry of dialects: every route-dependent table follows from its entries, so a dialect added
there is served on the lean path, in FastAPI's routes and schema, answers pre-route errors in its own
shape, and has its body-named session routed by Ray, with nothing else to edit."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.ray.asgi import HttpRequest
from tokentape.ray.routing import session_of
from tokentape.render.renderer import Renderer
from tokentape.server.app import GatewayApp
from tokentape.server.auth import GENERATION_ROUTES, Kind, decide, is_generation
from tokentape.server.dialects.registry import DIALECTS, PATHS, shape_for_path
from tokentape.server.errors import ANTHROPIC_ERRORS, OPENAI_ERRORS
from tokentape.server.serving import Dialect

# the generation routes as the API families name them, written out here (not read from the registry)
FAMILIES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/inference/v1/generate"]


def test_the_registry_lists_every_api_family_once() -> None:
    paths = [dialect.path for dialect in DIALECTS]
    assert sorted(paths) == sorted(FAMILIES)


@pytest.mark.parametrize("dialect", DIALECTS, ids=[d.path for d in DIALECTS])
async def test_each_entry_makes_every_table(
    engine: LlamaCppEngine, renderer: Renderer, dialect: type[Dialect[Any]]
) -> None:
    app = build(engine, renderer, model="m").app
    assert isinstance(app, GatewayApp) and app.lean is not None
    assert dialect.path in app.lean.routes
    schema = app.openapi()["paths"]
    for path in (dialect.path, "/sessions/{session_id}" + dialect.path):
        body = schema[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["title"] == dialect.request_model.__name__
    for path in (dialect.path, "/sessions/s" + dialect.path, dialect.path + "/"):
        assert shape_for_path(path) is dialect.errors
    body = orjson.dumps({"session_id": "named-in-body"})
    assert session_of(HttpRequest("POST", dialect.path, body=body)) == "named-in-body"
    # a session key may call it, at the root and under its own base URL, and it counts as generation
    assert frozenset(FAMILIES) == GENERATION_ROUTES and dialect.path in PATHS
    assert decide(Kind.SESSION, dialect.path, key_session="s") is None
    assert decide(Kind.SESSION, "/sessions/s" + dialect.path, key_session="s") is None
    assert is_generation(dialect.path) and is_generation("/sessions/s" + dialect.path)
    # and nothing else is: a session key is refused the trainer's routes beside it
    assert not is_generation(dialect.path + "/extra") and not is_generation("/v1/models")
    assert decide(Kind.SESSION, "/sessions", key_session="s") is not None


def test_paths_outside_the_dialects_answer_in_openai_shape() -> None:
    for path in ("/sessions", "/v1/models", "/admin/status", "/v1/messages/batches"):
        assert shape_for_path(path) is OPENAI_ERRORS
    assert session_of(HttpRequest("POST", "/v1/files", body=b'{"session_id": "x"}')) is None


async def test_a_rejection_before_any_route_is_in_the_dialects_shape(
    engine: LlamaCppEngine, renderer: Renderer
) -> None:
    """The guard answers a too-large body before the route runs: Messages gets Anthropic's shape."""
    app = build(engine, renderer, model="m", max_body_bytes=64).app
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tokentape") as http:
        for dialect in DIALECTS:
            response = await http.post(dialect.path, content=b"{" + b" " * 100 + b"}")
            assert response.status_code == 413
            if dialect.errors is ANTHROPIC_ERRORS:
                assert response.json()["type"] == "error"
            else:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

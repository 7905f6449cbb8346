"""A property over generated requests: whatever path, method, key placement and session naming a
holder of a session key tries, it is let through exactly when the route is one of its session's
generation routes and every session it names is its own; everything it is let through lands in its
own session, and every refusal leaves the store as it was. The expectation is computed from the rule
(tests/auth/walk.py), not from the guard's code."""

from __future__ import annotations

import asyncio
import string
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.auth.walk import MODEL, TRAINER, agent_route, bare, body_for, routes, snapshot, under_session
from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer

T = {"authorization": f"Bearer {TRAINER}"}


class Served:
    def __init__(self, engine: LlamaCppEngine, renderer: Renderer) -> None:
        self.loop = asyncio.new_event_loop()
        self.app = build(engine, renderer, model=MODEL, api_keys=(TRAINER,)).app
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t")
        self.keys = {name: self.run(self._create(name)) for name in ("ep-a", "ep-b")}
        templates = {path.replace("{session_id:session}", "{session_id}") for _, path in routes(self.app)}
        self.routes = sorted({bare(path) for path in templates})  # every route, as reached at the root
        self.real = {bare(path) for path in templates}
        self.under_sessions = {bare(path) for path in templates if under_session(path)}  # base-URL routes

    async def _create(self, name: str) -> str:
        key: str = (await self.http.post("/sessions", json={"session_id": name}, headers=T)).json()["api_key"]
        return key

    def run(self, work: Any) -> Any:
        return self.loop.run_until_complete(work)


@pytest.fixture(scope="module")
def served(engine: LlamaCppEngine, renderer: Renderer) -> Iterator[Served]:
    served = Served(engine, renderer)
    yield served
    served.run(served.http.aclose())
    served.loop.close()


NAMES = st.one_of(
    st.sampled_from(["ep-a", "ep-b", "ep-c"]),
    st.text(alphabet=string.ascii_letters + string.digits + "-._: /", min_size=1, max_size=6),
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_a_session_key_gets_exactly_its_own_sessions_generation_routes(served: Served, data: st.DataObject) -> None:
    own = data.draw(st.sampled_from(["ep-a", "ep-b"]), label="key of")
    route = data.draw(
        st.one_of(st.sampled_from(served.routes), st.text(alphabet="/v1abcdefmst", min_size=1, max_size=12)),
        label="route",
    )
    in_path = data.draw(st.none() | NAMES, label="session in the path")
    in_header = data.draw(st.none() | NAMES.filter(lambda n: n.strip() == n and "\n" not in n), label="X-Session-ID")
    in_body = data.draw(st.none() | NAMES, label="session_id field")
    placement = data.draw(st.sampled_from(["bearer", "x-api-key", "both"]), label="key placement")
    method = data.draw(st.sampled_from(["POST", "GET"]), label="method")

    key = served.keys[own]
    headers = {"authorization": f"Bearer {key}"} if placement == "bearer" else {"x-api-key": key}
    if placement == "both":  # Authorization wins over x-api-key
        headers = {"authorization": f"Bearer {key}", "x-api-key": "something-else"}
    if in_header is not None:
        headers["x-session-id"] = in_header
    route = route if route.startswith("/") else "/" + route
    path = route if in_path is None else f"/sessions/{in_path}{route}"
    body = dict(body_for(route) or {})
    if in_body is not None:
        body["session_id"] = in_body

    # the rule: a route of the app that agents may call; under a base URL, its own; at the root,
    # every name the request carries is its own
    allowed = route in served.real and agent_route(route)
    if in_path is not None:  # a base URL reaches only the routes served under it (/health is root-only)
        allowed = allowed and route in served.under_sessions and in_path == own
    else:
        allowed = allowed and all(name in (None, own) for name in (in_header, in_body if method == "POST" else None))

    before = served.run(snapshot(served.http))
    response = served.run(served.http.request(method, path, json=body, headers=headers))
    if allowed:
        assert response.status_code not in (401, 403), response.text
        landed = response.headers.get("x-session-id")
        assert landed in (None, own)
    else:
        assert response.status_code == 403, response.text
        assert served.run(snapshot(served.http)) == before

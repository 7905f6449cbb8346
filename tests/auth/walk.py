"""Every route of the app, called with every kind of key: what each key reached, and whether the
store stayed as it was after each refusal. Shared by the tests and `benchmarks/reliability.py`.

The routes come from the app itself (its OpenAPI schema, and the routes the schema leaves out:
/metrics and the docs), never from a list written here. What a session key may reach is written
here once, as the rule the README states, independently of `tokentape.server.auth`: the OpenAI-style
API under /v1 (at the root, or under its own session's base URL), vLLM's token route, and the root
token utilities and health probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "smollm2-135m-instruct"
TRAINER = "trainer-key-for-tests"
_SESSIONS = "/sessions/{session_id}"

BODIES: dict[str, dict[str, Any]] = {  # a valid request for each route that needs one
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 1},
    "/v1/messages": {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/inference/v1/generate": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}},
    "/v1/tokenize": {"prompt": "Hi"},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/sessions/{session_id}/reward": {"reward": 1.0},
    "/admin/engines": {"drain": "http://nowhere"},
}


def spoiled(key: str) -> str:
    """The key with its last character changed: the right shape, a wrong secret."""
    return key[:-1] + ("A" if key[-1] != "A" else "B")


def routes(app: Any) -> list[tuple[str, str]]:
    """(method, path template) of every route: the schema's, then those it leaves out."""
    found = [(method.upper(), path) for path, ops in app.openapi()["paths"].items() for method in ops]
    listed = {path for _, path in found}
    for route in app.routes:
        path = getattr(route, "path", None)
        if path and path not in listed and path.replace("{session_id:session}", "{session_id}") not in listed:
            found += [(m, path) for m in sorted(getattr(route, "methods", None) or ()) if m != "HEAD"]
    return found


def agent_route(path: str) -> bool:
    """What a session key may reach, path template stripped of its session prefix."""
    return path.startswith("/v1/") or path in ("/inference/v1/generate", "/tokenize", "/detokenize", "/health")


def under_session(template: str) -> bool:
    return template.startswith(_SESSIONS + "/")


def bare(template: str) -> str:
    """The route a base-URL path reaches (`/sessions/{session_id}/v1/models` -> `/v1/models`)."""
    if template.startswith(_SESSIONS + "/v1/") or template.startswith(_SESSIONS + "/inference/"):
        return template.removeprefix(_SESSIONS)
    return template


def body_for(template: str) -> dict[str, Any] | None:
    return BODIES.get(bare(template), BODIES.get(template))


def expected(kind: str, template: str) -> set[int] | None:
    """The statuses a key of `kind` may get on a route whose session is the own session's (`own`,
    `other`: a session key of this or of another session). None: any answer but 401 and 403."""
    if kind in ("none", "wrong", "wrong-shape"):
        return {200} if template == "/health" else {401}
    if kind == "trainer":
        return None
    route = bare(template)
    if not agent_route(route) or (kind == "other" and route != template):
        return {403}
    return {200}


def error_shape_ok(path: str, status: int, body: Any) -> bool:
    """401 and 403 in the dialect's error shape: Anthropic's on the Messages routes, OpenAI's elsewhere."""
    kind = {401: "authentication_error", 403: "permission_error"}[status]
    if path.rstrip("/").endswith(("/v1/messages", "/v1/messages/count_tokens")):
        return body.get("type") == "error" and body["error"]["type"] == kind and bool(body["error"]["message"])
    return body["error"]["type"] == kind and bool(body["error"]["code"]) and bool(body["error"]["message"])


@dataclass
class Walk:
    """What every key got on every route."""

    answers: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (kind, method, path) -> status
    problems: list[str] = field(default_factory=list)
    refusals: int = 0
    seconds: float = 0.0

    def reached(self, kind: str) -> list[str]:
        return sorted(
            f"{m} {p}" for (k, m, p), status in self.answers.items() if k == kind and status not in (401, 403)
        )


async def snapshot(http: httpx.AsyncClient) -> tuple[Any, ...]:
    """Everything a refused request could have changed, as the trainer reads it."""
    trainer = {"authorization": f"Bearer {TRAINER}"}
    export = (await http.get("/export", headers=trainer)).json()
    listing = (await http.get("/sessions", headers=trainer)).json()
    status = (await http.get("/admin/status", headers=trainer)).json()
    return export, listing, status["paused"], status["policy_version"]


async def walk(
    app: Any,
    http: httpx.AsyncClient,
    keys: dict[str, dict[str, str]],
    session_of: Callable[[str], str],
    *,
    key_sessions: dict[str, str] | None = None,
    check_store: bool = True,
) -> Walk:
    """Call every route with each set of headers in `keys` (kind -> headers), the trainer's last
    (its calls change things). `session_of(kind)` names the session put in the paths;
    `key_sessions` the session each session key belongs to (its generations must land there)."""
    result = Walk()
    start = time.perf_counter()
    order = sorted(keys, key=lambda kind: kind == "trainer")
    every = routes(app)
    for kind in order:
        todo = every if kind != "trainer" else sorted(every, key=_destructive_last)
        for method, template in todo:
            path = template.replace("{session_id:session}", "{session_id}").replace("{session_id}", session_of(kind))
            before = await snapshot(http) if check_store and kind != "trainer" else None
            response = await http.request(method, path, json=body_for(template), headers=keys[kind])
            status = response.status_code
            result.answers[(kind, method, template)] = status
            want = expected(kind, template)
            if (want is None and status in (401, 403)) or (want is not None and status not in want):
                result.problems.append(f"{kind} {method} {path}: {status} (expected {want or 'not 401/403'})")
            landed = response.headers.get("x-session-id")
            if key_sessions and kind in key_sessions and landed is not None and landed != key_sessions[kind]:
                result.problems.append(f"{kind} {method} {path}: landed in session {landed}")
            if status in (401, 403):
                result.refusals += 1
                if not error_shape_ok(path, status, response.json()):
                    result.problems.append(f"{kind} {method} {path}: error shape {response.text}")
                if before is not None and await snapshot(http) != before:
                    result.problems.append(f"{kind} {method} {path}: the store changed after a refusal")
            if method == "POST" and template == "/admin/pause" and status == 200:
                await http.post("/admin/resume", headers=keys[kind])
    result.seconds = time.perf_counter() - start
    return result


def _destructive_last(route: tuple[str, str]) -> int:
    method, path = route
    return ("/finish" in path) + 2 * (method == "DELETE") + 3 * (path == "/admin/pause")

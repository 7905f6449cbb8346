"""The generation routes, answered without FastAPI's routing and dependency layers.

On a short turn FastAPI's route matching (one regex per route), dependency solving and exception
middleware cost a good part of the server's CPU per request. This pure ASGI middleware answers POSTs
to the generation paths itself, with the same handlers and the same error mapping; FastAPI keeps those
routes for the OpenAPI schema (and the fuzzing that reads it) and serves every other path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["HotRoutes"]

Handler = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]

_SESSIONS = "/sessions/"


class HotRoutes:
    """`routes` maps a path under `/v1` (e.g. `/chat/completions`) to its handler; the same paths
    under `/sessions/{session_id}/v1` reach it with `session_id` as a path parameter."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler], on_error: ErrorHandler) -> None:
        self.app = app
        self.routes = dict(routes)
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self._match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if found is None:
            await self.app(scope, receive, send)
            return
        handler, session_id = found
        scope["path_params"] = {} if session_id is None else {"session_id": session_id}
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:  # mapped as FastAPI's exception handlers map it
            response = await self.on_error(request, exc)
        await response(scope, receive, send)

    def _match(self, path: str) -> tuple[Handler, str | None] | None:
        session_id: str | None = None
        if path.startswith(_SESSIONS):
            session_id, _, path = path[len(_SESSIONS) :].partition("/")
            if not session_id:
                return None
            path = "/" + path
        if not path.startswith("/v1/"):
            return None
        handler = self.routes.get(path[3:])
        return None if handler is None else (handler, session_id)

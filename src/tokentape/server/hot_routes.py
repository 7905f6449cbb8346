"""The generation routes' lean path: the app's front door for POSTs to them.

On a short turn, the ASGI layers in front of a FastAPI route (error and telemetry middleware, route
matching by one regex per route, dependency solving) cost a good part of the server's CPU per
request. The app hands these POSTs to `HotRoutes` before any of that runs: the same guard (keys,
limits), the same handlers, the same error mapping. FastAPI keeps the routes for the OpenAPI schema
(and the fuzzing that reads it) and serves every other path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokentape.server.middleware import Guard, replaying

__all__ = ["HotRoutes"]

Handler = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]

_SESSIONS = "/sessions/"


class HotRoutes:
    """`routes` maps a path (e.g. `/v1/chat/completions`) to its handler; the same path under
    `/sessions/{session_id}` reaches it with `session_id` as a path parameter."""

    def __init__(self, routes: Mapping[str, Handler], on_error: ErrorHandler, guard: Guard) -> None:
        self.routes = dict(routes)
        self.on_error = on_error
        self.guard = guard

    def match(self, scope: Scope) -> tuple[Handler, str | None] | None:
        """The handler and base-URL session of a request this path answers, else None."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path: str = scope["path"]
        session_id: str | None = None
        if path.startswith(_SESSIONS):
            session_id, _, path = path[len(_SESSIONS) :].partition("/")
            if not session_id:
                return None
            path = "/" + path
        handler = self.routes.get(path)
        return None if handler is None else (handler, session_id)

    async def serve(self, scope: Scope, receive: Receive, send: Send, handler: Handler, session_id: str | None) -> None:
        body = await self.guard.admit(scope, receive, send)
        if body is not None:
            try:
                await self._answer(scope, replaying(body, receive), send, handler, session_id, body)
            finally:
                self.guard.release(scope)

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, handler: Handler, session_id: str | None, body: bytes
    ) -> None:
        scope["path_params"] = {} if session_id is None else {"session_id": session_id}
        request = Request(scope, receive, send)
        request._body = body  # already read by the guard: Starlette's own cache of it, not read again
        try:
            response = await handler(request)
        except Exception as exc:  # mapped as FastAPI's exception handlers map it
            response = await self.on_error(request, exc)
        await response(scope, receive, send)

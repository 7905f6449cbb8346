"""One HTTP request as plain data, and an ASGI app run for it with its response streamed back.

This is what crosses Ray when a request reaches a gateway that does not own its session: the
request is handed to the owner's actor, which runs it through its own app and streams the
response messages back (server-sent events included). No HTTP hop, no proxy of our own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["App", "HttpRequest", "ResponseStart", "read_body", "run_app", "collect"]

Message = MutableMapping[str, Any]
App = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]


@dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""

    @classmethod
    def from_scope(cls, scope: MutableMapping[str, Any], body: bytes) -> HttpRequest:
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), tuple(scope["headers"]), body)

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key.lower() == name), None)

    def with_body(self, body: bytes) -> HttpRequest:
        headers = tuple((k, v) for k, v in self.headers if k.lower() != b"content-length")
        length = (b"content-length", b"%d" % len(body))
        return HttpRequest(self.method, self.path, self.query_string, (*headers, length), body)

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": self.query_string,
            "root_path": "",
            "headers": list(self.headers),
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
        }


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...] = field(default=())


async def read_body(receive: Callable[[], Awaitable[Message]], limit: int) -> tuple[bytes | None, bool]:
    """The whole request body (None past `limit` bytes: reading stops there), and whether the client
    left while it was being read."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None, False
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


async def run_app(
    app: App, request: HttpRequest, gone: asyncio.Event | None = None
) -> AsyncIterator[ResponseStart | bytes]:
    """Run `app` for `request`: first the status and headers, then the body in the chunks the app
    sent. Closing the iterator early, or setting `gone`, tells the app the client went away (a
    generation stops)."""
    outbox: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = gone if gone is not None else asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await outbox.put(message)

    async def serve() -> None:
        try:
            await app(request.scope(), receive, send)
        finally:
            await outbox.put(None)

    task = asyncio.get_running_loop().create_task(serve())
    try:
        while (message := await outbox.get()) is not None:
            if message["type"] == "http.response.start":
                headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
                yield ResponseStart(message["status"], headers)
            elif message["type"] == "http.response.body":
                if chunk := message.get("body", b""):
                    yield bytes(chunk)
                if not message.get("more_body", False):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, timeout=30)  # the app records the aborted turn, then returns


async def collect(parts: AsyncIterator[ResponseStart | bytes]) -> tuple[ResponseStart, bytes]:
    """A whole (non-streamed) response."""
    start: ResponseStart | None = None
    chunks: list[bytes] = []
    async for part in parts:
        if isinstance(part, ResponseStart):
            start = part
        else:
            chunks.append(part)
    if start is None:
        raise RuntimeError("the app sent no response")
    return start, b"".join(chunks)

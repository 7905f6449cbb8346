"""A transparent HTTP proxy that keeps, byte for byte, what passes between the gateway and an engine:
each request's body and the engine's answer (an SSE stream or one JSON body). A test instrument, to
compare the tape with what a real engine sent. Streams are relayed as they come, and a caller that
leaves closes the upstream stream too, so the engine sees the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["Exchange", "RecordingProxy"]

FORWARDED_HEADERS = ("content-type", "x-session-id", "accept")


@dataclass
class Exchange:
    path: str
    body: dict[str, Any] | None
    session_id: str | None
    status: int = 0
    raw: bytearray = field(default_factory=bytearray)
    complete: bool = False  # the engine's answer ended on its own (else the caller left first)

    def events(self) -> list[dict[str, Any]]:
        """The SSE `data:` events of a streamed answer, without `[DONE]`."""
        lines = bytes(self.raw).decode().splitlines()
        return [json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip() != "[DONE]"]

    def json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(bytes(self.raw))
        return data

    @property
    def streamed(self) -> bool:
        return bytes(self.raw).lstrip().startswith(b"data:")

    @property
    def done(self) -> bool:
        """The stream reached `data: [DONE]`."""
        return b"data: [DONE]" in self.raw


class RecordingProxy:
    """A raw ASGI app: it watches for the caller leaving while it still waits for the engine's first
    byte (an unstreamed answer comes all at the end), and then closes the upstream request."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._client: httpx.AsyncClient | None = None

    def generations(self, session_id: str) -> list[Exchange]:
        """The generation requests sent on behalf of one session, in order."""
        return [e for e in self.exchanges if e.session_id == session_id and e.body is not None]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        relay = asyncio.ensure_future(self._relay(scope, body, send))
        left = asyncio.ensure_future(_disconnected(receive))
        await asyncio.wait({relay, left}, return_when=asyncio.FIRST_COMPLETED)
        for task in (relay, left):
            task.cancel()  # the caller left: closing the upstream request tells the engine
        with contextlib.suppress(asyncio.CancelledError):
            await relay

    async def _relay(self, scope: dict[str, Any], body: bytes, send: Any) -> None:
        if self._client is None:  # made on the server's own event loop
            self._client = httpx.AsyncClient(base_url=self.upstream, timeout=600.0)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        exchange = Exchange(scope["path"], json.loads(body) if body else None, headers.get("x-session-id"))
        if scope["method"] == "POST":
            self.exchanges.append(exchange)
        upstream = self._client.build_request(
            scope["method"],
            scope["path"],
            params=scope["query_string"].decode(),
            content=body,
            headers={k: v for k, v in headers.items() if k in FORWARDED_HEADERS},
        )
        response = await self._client.send(upstream, stream=True)
        try:
            exchange.status = response.status_code
            media = response.headers.get("content-type", "application/octet-stream")
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(b"content-type", media.encode())],
                }
            )
            async for chunk in response.aiter_raw():
                exchange.raw += chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            exchange.complete = True
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass

"""The Ray routing layer reads a request's body before any app sees it (to find the session it names),
so the body limit applies there first: on the front process and on every gateway alike. No Ray here:
the routing object is driven with raw ASGI messages and peers that record what reaches them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from tokentape.ray.asgi import HttpRequest, ResponseStart
from tokentape.ray.routing import OwnerRouting

LIMIT = 1024


class RecordingPeers:
    self_index = None

    def __init__(self) -> None:
        self.forwarded: list[HttpRequest] = []

    async def owner(self, session_id: str, group_id: str | None = None) -> int:
        return 0

    async def least_loaded(self) -> int:
        return 0

    async def gateways(self) -> dict[int, str]:
        return {0: "http://gateway-0"}

    async def forward(self, index: int, request: HttpRequest) -> AsyncIterator[ResponseStart | bytes]:
        self.forwarded.append(request)
        yield ResponseStart(200, ((b"content-type", b"application/json"),))
        yield b"{}"

    async def finished(self, session_id: str) -> None:
        return None

    async def forget(self, session_id: str) -> None:
        return None


async def _call(path: str, chunks: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, Any, int]:
    """Status, JSON body and how many body chunks the routing read."""
    peers = RecordingPeers()
    routing = OwnerRouting(None, peers, max_body_bytes=LIMIT)
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        chunk = await anext(chunks, None)
        if chunk is None:
            return {"type": "http.disconnect"}
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": headers}
    await routing(scope, receive, send)
    assert peers.forwarded == []  # nothing past the limit reaches a gateway
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, orjson.loads(body), read


async def _endless() -> AsyncIterator[bytes]:
    while True:
        yield b"x" * 100


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/chat/completions", "error"), ("/v1/messages", "anthropic")],
)
async def test_a_body_past_the_limit_is_refused_before_it_is_read_whole(path: str, shape: str) -> None:
    status, body, read = await _call(path, _endless(), [(b"x-session-id", b"s1")])
    assert status == 413
    assert read == LIMIT // 100 + 1  # an endless body read no further than the limit
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"  # Anthropic's own 413 type
    else:
        assert body["error"]["code"] == "request_too_large"


async def test_a_declared_length_past_the_limit_is_refused_unread() -> None:
    headers = [(b"content-length", b"%d" % (LIMIT + 1)), (b"x-session-id", b"s1")]
    status, body, read = await _call("/v1/chat/completions", _endless(), headers)
    assert (status, read) == (413, 0)
    assert str(LIMIT) in body["error"]["message"]

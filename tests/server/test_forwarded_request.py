"""A request handed from one gateway to the owner of its session (under Ray) is run through the owner's
app by `run_app`. When the client at the first gateway leaves, that gateway says so explicitly; the
owner's app must then see a disconnect and stop streaming, while the owner is still reading its output.
No Ray here: the app is a Starlette stream that would run forever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tokentape.ray.asgi import HttpRequest, ResponseStart, run_app
from tokentape.ray.routing import OwnerRouting


def _endless(stopped: asyncio.Event) -> Starlette:
    async def tokens(_: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: {}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                stopped.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", tokens, methods=["POST"])])


async def _read_until_gone(parts: AsyncIterator[ResponseStart | bytes], gone: asyncio.Event) -> int:
    chunks = 0
    async for part in parts:
        if isinstance(part, bytes):
            chunks += 1
            if chunks == 3:
                gone.set()  # the forwarding gateway's client left; this side keeps reading
    return chunks


REQUEST = HttpRequest("POST", "/v1/chat/completions", b"", ((b"content-type", b"application/json"),), b"{}")


async def test_a_request_marked_gone_stops_the_apps_stream_while_its_output_is_still_read() -> None:
    stopped, gone = asyncio.Event(), asyncio.Event()
    chunks = await asyncio.wait_for(_read_until_gone(run_app(_endless(stopped), REQUEST, gone), gone), timeout=10)
    assert stopped.is_set(), "the app's stream ended"
    assert chunks < 100, "it ended soon after the mark, not by running on"


async def test_the_owner_routing_passes_the_mark_to_the_app() -> None:
    stopped, gone = asyncio.Event(), asyncio.Event()
    routing = OwnerRouting(_endless(stopped), peers=None)  # type: ignore[arg-type]  # a local request asks no peer
    await asyncio.wait_for(_read_until_gone(routing.local(REQUEST, gone), gone), timeout=10)
    assert stopped.is_set()

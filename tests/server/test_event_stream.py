"""The generation routes' stream on its own: every chunk and the end when the client stays; when it
leaves, the stream stops, the chunks' source is closed and nothing is raised; a cancellation that is
not a disconnect goes on up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest
from starlette.background import BackgroundTask

from tokentape.server.serving import EventStream

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


class Client:
    """ASGI's receive and send: records what is sent; `leave()` makes receive answer a disconnect."""

    def __init__(self) -> None:
        self.sent: list[MutableMapping[str, Any]] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)
        await asyncio.sleep(0)

    def leave(self) -> None:
        self.gone.set()

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


class Source:
    """Chunks, one every `pause` seconds; records whether it was closed and how far it got."""

    def __init__(self, count: int, pause: float = 0.0) -> None:
        self.count, self.pause = count, pause
        self.made = 0
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            for i in range(self.count):
                await asyncio.sleep(self.pause)
                self.made += 1
                yield f"data: {i}\n\n".encode()
        finally:
            self.closed = True


async def streaming(client: Client, source: Source) -> asyncio.Task[None]:
    """A stream of `source` to `client` under way: three chunks made."""
    task = asyncio.create_task(EventStream(source.chunks())(SCOPE, client.receive, client.send))
    while source.made < 3:
        await asyncio.sleep(0.005)
    return task


async def test_a_client_that_stays_gets_every_chunk_and_the_end() -> None:
    client, source = Client(), Source(5)
    await EventStream(source.chunks(), media_type="text/event-stream", headers={"X-Session-ID": "s"})(
        SCOPE, client.receive, client.send
    )
    assert client.sent[0]["type"] == "http.response.start" and client.sent[0]["status"] == 200
    assert (b"x-session-id", b"s") in client.sent[0]["headers"]
    assert client.bodies == [f"data: {i}\n\n".encode() for i in range(5)] + [b""]
    assert client.sent[-1]["more_body"] is False and source.closed


async def test_a_client_that_leaves_stops_the_stream_and_closes_its_source() -> None:
    client, source = Client(), Source(1000, pause=0.005)
    task = await streaming(client, source)
    client.leave()
    made = source.made
    await asyncio.wait_for(task, 5)  # returns, raising nothing
    assert source.closed and source.made <= made + 1  # stopped at once, not at the source's end
    assert client.bodies[-1] != b""  # no end was sent to nobody
    assert not task.cancelled() and task.cancelling() == 0  # taken back: later awaits in it are not cut


async def test_a_cancellation_that_is_no_disconnect_goes_on_up() -> None:
    client, source = Client(), Source(1000, pause=0.005)
    task = await streaming(client, source)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.closed


async def test_a_background_task_runs_after_the_stream_as_starlettes_does() -> None:
    client, source, ran = Client(), Source(2), []
    stream = EventStream(source.chunks(), background=BackgroundTask(lambda: ran.append(len(client.sent))))
    await stream(SCOPE, client.receive, client.send)
    assert ran == [4]  # the start, two chunks and the end were sent first

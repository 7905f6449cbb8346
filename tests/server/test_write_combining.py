"""What one turn of the event loop writes to a client goes out in one write (`server.write_combining`),
and nothing waits past that turn: a stream's chunk reaches the client before the next is made."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, ClassVar

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from tests.support.fake_engines import serving
from tokentape.cli import app as cli
from tokentape.server.connections import ConnectionLimits
from tokentape.server.write_combining import FLUSH_AT_BYTES, CombinedWrites, WriteCombiningHttpTools


class RecordingTransport:
    """The socket's side: every call that would reach the kernel, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", [bytes(data)]))

    def writelines(self, lines: list[bytes]) -> None:
        self.calls.append(("writelines", [bytes(x) for x in lines]))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.calls.append(("close", []))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", []))
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1234) if name == "peername" else default


async def _turn() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def test_the_writes_of_one_turn_go_out_together_in_order_after_it() -> None:
    transport = RecordingTransport()
    combined = CombinedWrites(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
    combined.write(b"head ")
    combined.write(b"")
    combined.writelines([b"body ", memoryview(b"more")])
    assert transport.calls == [], "nothing is written within the turn"
    await _turn()
    assert transport.calls == [("writelines", [b"head ", b"body ", b"more"])]
    combined.write(b"alone")
    await _turn()
    assert transport.calls[-1] == ("write", [b"alone"])
    assert combined.get_extra_info("peername") == ("127.0.0.1", 1234)


async def test_a_large_write_goes_out_at_once() -> None:
    transport = RecordingTransport()
    combined = CombinedWrites(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
    combined.write(b"h")
    combined.write(b"x" * (FLUSH_AT_BYTES - 1))
    assert transport.calls == [("writelines", [b"h", b"x" * (FLUSH_AT_BYTES - 1)])]
    await _turn()
    assert len(transport.calls) == 1, "the queued flush finds nothing left"


async def test_close_writes_what_is_held_first_and_a_closing_connection_gets_nothing() -> None:
    transport = RecordingTransport()
    combined = CombinedWrites(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
    combined.write(b"last")
    combined.close()
    assert transport.calls == [("write", [b"last"]), ("close", [])]
    combined.write(b"late")
    await _turn()
    assert transport.calls == [("write", [b"last"]), ("close", [])], "written after closing: dropped"

    aborted = RecordingTransport()
    combined = CombinedWrites(aborted, asyncio.get_running_loop())  # type: ignore[arg-type]
    combined.write(b"held")
    combined.abort()
    await _turn()
    assert aborted.calls == [("abort", [])]


class Counting(WriteCombiningHttpTools):
    """The protocol, with the calls that reach the real transport recorded."""

    seen: ClassVar[list[tuple[str, bytes]]] = []

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        outer = self

        class Spy:
            def write(self, data: bytes) -> None:
                outer.seen.append(("write", bytes(data)))
                transport.write(data)

            def writelines(self, lines: list[bytes]) -> None:
                outer.seen.append(("writelines", b"".join(lines)))
                transport.writelines(lines)

            def __getattr__(self, name: str) -> Any:
                return getattr(transport, name)

        super().connection_made(Spy())  # type: ignore[arg-type]


def _served(app: Starlette) -> contextlib.AbstractContextManager[str]:
    return serving(app, loop="uvloop", http=Counting)


def test_a_whole_answer_reaches_the_socket_in_one_write() -> None:
    async def answer(request: Request) -> JSONResponse:
        return JSONResponse({"answer": "x" * 3000})

    Counting.seen = []
    with _served(Starlette(routes=[Route("/a", answer)])) as url, httpx.Client() as client:
        for _ in range(3):  # on one kept connection
            reply = client.get(f"{url}/a")
            assert reply.json() == {"answer": "x" * 3000}
        closing = client.get(f"{url}/a", headers={"Connection": "close"})
        assert closing.json() == {"answer": "x" * 3000}
    assert len(Counting.seen) == 4, Counting.seen
    for _, data in Counting.seen:
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and body == b'{"answer":"' + b"x" * 3000 + b'"}'


def test_a_streamed_chunk_reaches_the_client_before_the_next_is_made() -> None:
    read_first = threading.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: first\n\n"
        # the client says it read the first chunk; a chunk held past its turn never reaches it
        deadline = time.monotonic() + 10
        while not read_first.is_set():
            if time.monotonic() > deadline:
                raise AssertionError("the first chunk never reached the client")
            await asyncio.sleep(0.005)
        yield b"data: second\n\n"

    async def stream(request: Request) -> StreamingResponse:
        return StreamingResponse(chunks(), media_type="text/event-stream")

    with (
        _served(Starlette(routes=[Route("/s", stream)])) as url,
        httpx.Client(timeout=20) as client,
        client.stream("GET", f"{url}/s") as reply,
    ):
        pieces = reply.iter_bytes()
        assert next(pieces) == b"data: first\n\n"
        read_first.set()
        assert b"".join(pieces) == b"data: second\n\n"


def test_serve_runs_uvicorn_with_the_write_combining_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokentape.served as served

    given: dict[str, Any] = {}
    monkeypatch.setattr(served, "build_served", lambda spec, **_: SimpleNamespace(app=None, model_id="m"))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: given.update(k))
    result = CliRunner().invoke(cli, ["serve", "--store", ":memory:"])
    assert result.exit_code == 0, result.output
    # the bounded protocol (`server.connections`), which writes through `CombinedWrites` too
    assert issubclass(given["http"], WriteCombiningHttpTools)
    assert given["http"].limits == ConnectionLimits()  # the serve options' defaults are the protocol's
    assert given["loop"] == "uvloop"

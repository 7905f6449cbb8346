"""The generations' HTTP/1.1 exchange (`engines/http1.py`) against raw servers written here, each
driving one case directly: bytes cut anywhere, connections the engine drops, bodies that end with the
connection, a full pool, silence, answers that are not HTTP, and a fast stream held back."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from tokentape.engines.http import lines_ahead
from tokentape.engines.http1 import Http1Pool, PoolTimeout, TransportError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server running `handler` per connection; yields its URL and a list that counts connections."""
    connections: list[int] = []

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connections
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (by its content-length); the head is returned."""
    head = await reader.readuntil(b"\r\n\r\n")
    fields = [line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line]
    length = next(int(value) for name, value in fields if name.strip().lower() == b"content-length")
    await reader.readexactly(length)
    return head


def pool(url: str, **options: float) -> Http1Pool:
    settings = {"limit": 4, "keepalive": 4.0, "connect_timeout": 2.0, "pool_timeout": 2.0, "read_timeout": 5.0}
    return Http1Pool(url, **{**settings, **options})  # type: ignore[arg-type]


async def post(http: Http1Pool, body: bytes = b"{}") -> bytes:
    response = await http.post("/v1/completions", body, {"Content-Type": "application/json"})
    data = await response.read()
    response.release()
    return data


async def test_answers_are_read_whole_and_their_connection_serves_the_next() -> None:
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(OK % (7, b'{"n": 1}'[:7]))

    async with raw_server(answer) as (url, connections):
        http = pool(url)
        assert [await post(http) for _ in range(5)] == [b'{"n": 1'] * 5
        assert len(connections) == 1
        head = seen[0].decode()
        assert head.startswith("POST /v1/completions HTTP/1.1\r\n") and f"Host: {url[7:]}\r\n" in head
        await http.close()


async def test_a_base_url_with_a_path_prefixes_every_request() -> None:
    """An engine behind a reverse proxy at http://host/some/path: requests go under that path."""
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(OK % (2, b"{}"))

    async with raw_server(answer) as (url, _):
        http = pool(f"{url}/engines/a/")
        assert await post(http) == b"{}"
        assert seen[0].startswith(b"POST /engines/a/v1/completions HTTP/1.1\r\n")
        await http.close()


async def test_lines_survive_any_cut() -> None:
    long_line = b"data: " + b"x" * 3_000_000  # beyond HIGH_WATER: reading pauses and resumes
    expected = [b'data: {"a": 1}', b"", long_line, b"", b": comment", b"data: [DONE]", b"", b"tail"]
    body = b'data: {"a": 1}\r\n\r\n' + long_line + b"\n\n: comment\ndata: [DONE]\r\n\r\ntail"
    rng = random.Random(7)
    for trial in range(8):
        cuts = sorted(set(range(1, 20)) | {rng.randrange(len(body)) for _ in range(40)}) if trial else []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cuts: list[int] = cuts) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
                if end > start:
                    writer.write(b"%x\r\n%s\r\n" % (end - start, body[start:end]))
                    await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        async with raw_server(answer) as (url, _):
            http = pool(url)
            response = await http.post("/", b"{}", {})
            assert response.content_type == "text/event-stream"
            got = [line async for line, _ in lines_ahead(response.chunks())]
            response.release()
            await http.close()
        assert got == expected, (trial, [g[:40] for g in got])


async def test_an_answer_not_read_holds_the_engine_back_instead_of_filling_memory() -> None:
    """Past HIGH_WATER buffered bytes the connection stops reading: a 64 MB answer that nobody reads
    for a while cannot be written whole (the engine's writes wait), and arrives whole once read."""
    size = 64 << 20
    written: list[float] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()
        written.append(asyncio.get_running_loop().time())

    async with raw_server(answer) as (url, _):
        http = pool(url)
        response = await http.post("/", b"{}", {})
        waited_until = asyncio.get_running_loop().time() + 0.5
        await asyncio.sleep(0.5)  # nobody reads
        assert not written, "the whole answer was taken in while nobody read it"
        assert len(await response.read()) == size
        assert written and written[0] >= waited_until
        response.release()
        await http.close()


async def test_a_kept_connection_the_engine_dropped_is_retried_on_a_new_one() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK % (2, b"{}"))
        await writer.drain()
        if len(connections) == 1:  # the first connection: the next request is read, then dropped unanswered
            await read_request(reader)

    async with raw_server(answer) as (url, connections):
        http = pool(url)
        assert await post(http) == b"{}"
        assert await post(http) == b"{}"  # went out on the kept connection, which the engine then dropped
        assert len(connections) == 2 and http.connections_made == 2


async def test_a_new_connection_dropped_before_answering_fails() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with raw_server(drop) as (url, connections):
        with pytest.raises(TransportError, match="closed the connection before answering"):
            await post(pool(url))
        assert len(connections) == 1  # not retried: the engine may have taken the request


async def test_a_body_without_length_ends_with_the_connection_and_is_not_kept() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json; charset=utf-8\r\n\r\n{"whole": true}')

    async with raw_server(answer) as (url, connections):
        http = pool(url)
        response = await http.post("/", b"{}", {})
        assert response.content_type == "application/json"
        assert await response.read() == b'{"whole": true}'
        response.release()
        assert await post(http) == b'{"whole": true}'
        assert len(connections) == 2


async def test_connection_close_is_honoured_and_keepalive_expires() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            close = len(connections) == 1
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n%s\r\n{}" % (b"connection: close\r\n" if close else b"")
            )

    async with raw_server(answer) as (url, connections):
        http = pool(url, keepalive=0.2)
        await post(http)
        await post(http)  # the first said close: a second connection
        await post(http)  # kept
        assert len(connections) == 2
        await asyncio.sleep(0.3)
        await post(http)  # idle past keepalive: not reused
        assert len(connections) == 3
        await http.close()


async def test_a_full_pool_makes_the_next_request_wait_then_time_out() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK % (2, b"{}"))

    async with raw_server(answer) as (url, _):
        http = pool(url, limit=1, pool_timeout=0.2)
        held = await http.post("/", b"{}", {})
        with pytest.raises(PoolTimeout):
            await post(http)
        waiting = asyncio.ensure_future(post(http))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        held.close()  # the slot comes free: the waiting request goes out
        assert await waiting == b"{}"
        cancelled = asyncio.ensure_future(http.post("/", b"{}", {}))
        await asyncio.sleep(0)
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        assert await post(http) == b"{}"  # a cancelled request gave its slot back
        await http.close()


async def test_silence_past_the_read_timeout_fails_the_exchange() -> None:
    async def head_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if len(connections) == 2:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}")
        await asyncio.sleep(5)

    async with raw_server(head_only) as (url, connections):
        http = pool(url, read_timeout=0.2, limit=1)
        with pytest.raises(TimeoutError):  # no head
            await http.post("/", b"{}", {})
        response = await http.post("/", b"{}", {})  # the slot of the failed one is free again
        with pytest.raises(TimeoutError):  # a head, then silence
            await response.read()
        response.close()
        await http.close()


async def test_what_is_not_http_fails_and_a_header_with_a_line_break_is_never_sent() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await asyncio.sleep(1)

    async with raw_server(garbage) as (url, connections):
        http = pool(url)
        with pytest.raises(TransportError, match="not valid HTTP"):
            await post(http)
        with pytest.raises(ValueError, match="line break"):
            await http.post("/", b"{}", {"X-Session-ID": "a\r\nX-Admin: 1"})
        assert len(connections) == 1


async def test_a_pool_for_an_engine_reached_another_way_refuses_only_when_used() -> None:
    http = pool("ray://tokentape-engine-0")  # a Ray actor engine shares the remote plumbing, not HTTP
    with pytest.raises(TransportError, match="http"):
        await post(http)


async def test_a_refused_connection_is_a_transport_error() -> None:
    async with raw_server(read_request) as (url, _):
        pass  # closed: nothing listens there any more
    with pytest.raises(TransportError, match="could not connect"):
        await post(pool(url))


def test_the_exchange_runs_on_uvloop_as_the_server_does() -> None:
    """The gateway serves on uvloop, whose transports are not asyncio's classes."""
    import uvloop

    async def exchanges() -> None:
        await test_answers_are_read_whole_and_their_connection_serves_the_next()
        await test_a_kept_connection_the_engine_dropped_is_retried_on_a_new_one()

    uvloop.run(exchanges())

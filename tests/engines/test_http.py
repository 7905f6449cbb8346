"""Reading an engine's event stream however its bytes are cut into packets; the control routes'
aiohttp pools. The generations' own HTTP/1.1 exchange is tests/engines/test_http1.py."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from tokentape.engines.http import ConnectionPool, lines


async def _serve_in_pieces(body: bytes, cuts: list[int]) -> tuple[asyncio.Server, str]:
    """A raw HTTP/1.1 server that sends `body` (chunked) in separate writes cut at `cuts`."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
            if end > start:
                writer.write(b"%x\r\n%s\r\n" % (end - start, body[start:end]))
                await writer.drain()
                await asyncio.sleep(0)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def test_lines_survive_any_cut() -> None:
    long_line = b"data: " + b"x" * 3_000_000  # beyond aiohttp's own readline limit
    expected = [b'data: {"a": 1}', b"", long_line, b"", b": comment", b"data: [DONE]", b"", b"tail"]
    body = b'data: {"a": 1}\r\n\r\n' + long_line + b"\n\n: comment\ndata: [DONE]\r\n\r\ntail"
    rng = random.Random(7)
    for trial in range(12):
        # cut everywhere for the small part (between \r and \n included), at random in the long line
        cuts = sorted(set(range(1, 20)) | {rng.randrange(len(body)) for _ in range(40)}) if trial else []
        server, url = await _serve_in_pieces(body, cuts)
        pool = ConnectionPool(url, limit=2, keepalive=None, timeout=aiohttp.ClientTimeout(total=30))
        try:
            async with pool.session().get("/") as response:
                got = [line async for line in lines(response.content.iter_any())]
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()
        assert got == expected, (trial, [g[:40] for g in got])


async def test_a_pool_follows_the_running_loop() -> None:
    pool = ConnectionPool("http://127.0.0.1:1", limit=1, keepalive=4.0, timeout=aiohttp.ClientTimeout(total=1))
    first = pool.session()
    assert pool.session() is first
    await first.close()
    assert pool.session() is not first  # a closed session is replaced on next use
    await pool.close()

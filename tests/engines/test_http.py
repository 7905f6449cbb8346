"""Reading an engine's event stream however its bytes are cut into packets; the control routes'
aiohttp pools. The generations' own HTTP/1.1 exchange is tests/engines/test_http1.py."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentape.engines.http import ConnectionPool, lines_ahead


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
                got = [line async for line, _ in lines_ahead(response.content.iter_any())]
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


async def _from(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _expected_ahead(body: bytes, cuts: list[int]) -> list[tuple[bytes, bool]]:
    """By offsets alone: each line, and whether a later line that is not blank ended (its `\\n`) within
    the read that completed this one."""
    ends = [i for i, byte in enumerate(body) if byte == ord("\n")]
    reads = [*cuts, len(body)]
    out: list[tuple[bytes, bool]] = []
    start = 0
    for k, end in enumerate(ends):
        line = body[start:end].removesuffix(b"\r")
        read_end = next(r for r in reads if r > end)  # the read that brought this line's `\n`
        ahead = any(
            body[ends[j - 1] + 1 if j else 0 : ends[j]].strip() for j in range(k + 1, len(ends)) if ends[j] < read_end
        )
        out.append((line, ahead))
        start = end + 1
    if start < len(body):
        out.append((body[start:], False))
    return out


@settings(max_examples=300, deadline=None)
@given(
    lines_=st.lists(
        st.sampled_from([b"", b"data: {}", b'data: {"a": 1}', b": c", b"data: [DONE]", b"x\r"]), max_size=12
    ),
    cuts=st.lists(st.integers(1, 200), max_size=8),
)
async def test_lines_ahead_says_whether_a_later_line_came_in_the_same_read(
    lines_: list[bytes], cuts: list[int]
) -> None:
    body = b"\n".join(lines_) + (b"\n" if lines_ else b"")
    cuts = sorted({c for c in cuts if c < len(body)})
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]  # reads are never empty
    got = [pair async for pair in lines_ahead(_from(chunks))]
    assert got == _expected_ahead(body, cuts)

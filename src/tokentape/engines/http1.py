"""HTTP/1.1 keep-alive connections for generations, answers parsed by httptools (llhttp, in C).

A generation is one POST and one answer, on a connection kept open for the next. That is all a
generation needs of HTTP, and aiohttp's client does much more per request (request and response
objects, cookie jar, tracing hooks, timers, redirects): on loopback its exchange cost 0.155 ms of
CPU against 0.047 ms for this one, a tenth of the gateway's CPU per request. Probes and control calls
(rare, any method, any answer) stay on aiohttp (`engines/http.py`).

What is kept of a full client: a limit on connections (a caller waits for a free one, at most
`pool_timeout` seconds), connect and silence timeouts, connections reused only while younger than
`keepalive` and only after a whole answer, one retry on a fresh connection when a reused one turns
out closed before any byte of the answer came (the engine dropped it while idle), chunked and
length-delimited bodies and bodies that end with the connection, backpressure on a fast stream, and
cancellation at any point: an answer not read to its end closes its connection (which is how an
engine learns that nobody reads the generation), and its slot is freed exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from typing import cast

import httptools

from tokentape.version import VERSION

__all__ = ["Http1Pool", "Http1Response", "PoolTimeout", "TransportError"]

HIGH_WATER = 1 << 20  # bytes of an answer buffered before reading from the socket pauses


class TransportError(Exception):
    """The exchange failed below HTTP: no connection, a connection lost, an answer HTTP does not allow."""


class PoolTimeout(TransportError):
    """No connection came free within the pool's timeout."""


class _Connection(asyncio.Protocol):
    """One TCP connection and the exchange on it, if any (one at a time)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = ""
        self.keep_alive = False
        self.framed = False  # content-length or chunked: the answer does not end with the connection
        self.received = False  # any byte of this answer
        self.head_done = False
        self.complete = False
        self.error: BaseException | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.active = False

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of asyncio's

    def data_received(self, data: bytes) -> None:
        if not self.active:  # bytes nobody asked for: the connection is no longer trusted
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportError(f"the engine's answer is not valid HTTP: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost says what that means

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.active or self.complete:
            return
        if exc is None and self.head_done and not self.framed:
            self.complete = True  # a body without length or chunks ends with the connection
            self._wake()
        else:
            where = "" if self.received else " before answering"
            self._fail(TransportError(f"the engine closed the connection{where}"))

    # -- httptools callbacks -----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- the exchange ------------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def start(self, request: list[bytes]) -> None:
        self._reset()
        self.active = True
        assert self.transport is not None
        self.transport.writelines(request)

    async def wait(self, timeout: float | None) -> None:
        """Until something new happened (bytes, the end, an error), at most `timeout` seconds."""
        if self.error is not None:
            raise self.error
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        # a timer on the loop rather than asyncio.timeout: this wait runs a few times a request
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Http1Response:
    """An answer's head, and its body read whole (`read`) or as it comes (`chunks`). `release` or
    `close` it once done: released after the whole body, its connection serves the next request."""

    __slots__ = ("_conn", "_generation", "_pool", "_settled", "content_type", "status")

    def __init__(self, pool: Http1Pool, conn: _Connection, generation: int) -> None:
        self._pool, self._conn = pool, conn
        self._settled = False
        self._generation = generation
        self.status = conn.status
        self.content_type = conn.content_type

    async def read(self) -> bytes:
        parts = [part async for part in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they come; at most the pool's `read_timeout` seconds of silence."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            await conn.wait(self._pool.read_timeout)

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the answer was read whole and
        the engine keeps it open; it is closed otherwise."""
        if self._settled:
            return
        self._settled = True
        conn = self._conn
        reusable = conn.complete and not conn.chunks and conn.keep_alive and not conn.closed and conn.error is None
        self._pool.give_back(conn, reusable, self._generation)

    def close(self) -> None:
        """Done before the answer's end: the connection is closed (the engine stops generating)."""
        if self._settled:
            return
        self._settled = True
        self._pool.give_back(self._conn, False, self._generation)


class Http1Pool:
    """Keep-alive connections to one engine (`base_url`, http or https), at most `limit` in use."""

    def __init__(
        self,
        base_url: str,
        *,
        limit: int,
        keepalive: float,
        connect_timeout: float,
        pool_timeout: float,
        read_timeout: float | None,
    ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        # an engine that is reached another way (a Ray actor, `ray://name`) never posts through its pool
        self._unusable: str | None = None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            self._unusable = f"an engine URL is http(s)://host[:port][/path]; got {base_url!r}"
        self.host = parts.hostname or ""
        self.port = (parts.port or (443 if parts.scheme == "https" else 80)) if self._unusable is None else 0
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.limit = limit
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self.pool_timeout = pool_timeout
        self.read_timeout = read_timeout
        netloc = parts.netloc.rpartition("@")[2]  # never credentials in a Host header
        self._head = f"Host: {netloc}\r\nUser-Agent: tokentape/{VERSION}\r\nAccept-Encoding: identity\r\n"
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(limit)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generation = 0  # of the loop's slots: a slot of an earlier loop is not given back to these
        self.connections_made = 0

    def _bind(self) -> None:
        """Connections and slots belong to one event loop: a pool used from another starts afresh."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._idle = []
            self._slots = asyncio.Semaphore(self.limit)
            self._generation += 1

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Http1Response:
        """Send the request and wait for the answer's head. Raises `TransportError` (`PoolTimeout`
        when no connection came free) or TimeoutError (no head within `read_timeout`); ValueError for
        a header that HTTP cannot carry, before anything is sent."""
        if self._unusable is not None:
            raise TransportError(self._unusable)
        lines = [self._head]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"the header {name!r} has a line break in it")
            lines.append(f"{name}: {value}\r\n")
        request = [
            f"POST {self.prefix}{path} HTTP/1.1\r\n{''.join(lines)}Content-Length: {len(body)}\r\n\r\n".encode(),
            body,
        ]
        self._bind()
        if not self._slots.locked():
            await self._slots.acquire()  # free: taken without waiting, and without a timer on the loop
        else:
            try:
                async with asyncio.timeout(self.pool_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise PoolTimeout(f"no connection came free within {self.pool_timeout:.0f} s") from None
        handed_over = False
        try:
            conn = await self._exchange(request)
            handed_over = True
            return Http1Response(self, conn, self._generation)
        finally:
            if not handed_over:
                self._slots.release()

    async def _exchange(self, request: list[bytes]) -> _Connection:
        """The connection whose answer's head has come (the slot is the caller's)."""
        for attempt in range(2):
            conn = await self._connection(kept=attempt == 0)
            try:
                conn.start(request)
                while not conn.head_done:
                    await conn.wait(self.read_timeout)
                return conn
            except TransportError:
                conn.close()
                # a kept connection the engine had closed while it was idle: once more on a new one
                if attempt == 0 and conn.reused and not conn.received:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    async def _connection(self, *, kept: bool = True) -> _Connection:
        """A kept connection if one is idle and young enough (`kept`), else a new one. After a kept
        one turned out dropped, the others kept as long are likely dropped too: the retry is new."""
        now = time.monotonic()
        while kept and self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive:
                conn.reused = True
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    _Connection, self.host, self.port, ssl=self.ssl, server_hostname=self.host if self.ssl else None
                )
        except TimeoutError:
            raise TransportError(f"could not connect within {self.connect_timeout:.0f} s") from None
        except OSError as exc:
            raise TransportError(f"could not connect: {exc}") from exc
        self.connections_made += 1
        return conn

    def give_back(self, conn: _Connection, reusable: bool, generation: int) -> None:
        """The end of an exchange: the connection kept (idle) or closed, and its slot freed."""
        conn.active = False
        if generation != self._generation:  # made in an event loop this pool no longer serves
            conn.close()
            return
        if reusable:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        self._slots.release()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

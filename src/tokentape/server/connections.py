"""What one client connection may hold and how long it may stall, bounded before the app runs.

uvicorn's httptools protocol sets no bound of its own on a request's head: a client may send megabytes
of tiny headers (each kept as a tuple of two byte strings, about 130 bytes of Python objects for 5
bytes on the wire), take as long as it likes to send them, stop a body half way, or stop reading a
response while the gateway waits to write the rest of it (holding the request's admission slot).
And a connection that ends while its keep-alive timer is armed stays referenced by that timer, with
everything its last request held, until the timer fires: uvicorn cancels it only on a clean close,
not when the client resets the connection.

`BoundedHttpTools` is that protocol (with its writes combined, `write_combining`) and:
- a request's head (request line and headers, as read off the wire) is at most `max_header_bytes`
  and `max_headers` headers: past either it answers 431 and closes, before the app sees the request;
- the head must arrive within `header_seconds` of its first byte (of the connection's opening, for
  its first request): else 408 and the connection closes (a silent new connection just closes);
- a body may not stop arriving for `body_seconds` (while the app waits for it): else 408 and close;
- a client may not stop reading for `send_seconds` while a response waits to be written: the
  connection is then dropped, which the app sees as the client gone (a stream stops generating,
  its turn is recorded as any cut-off stream's is, its admission slot and retry claim are released);
- a connection that ends drops its timers and what its requests held, however it ended.

Refusals are in the error shape of the dialect at the request's path, as the app's own are. Timers
cost a request nothing when its head and body come in one read (none is armed), and a stalled one
is checked once per window, not on every read.
"""

from __future__ import annotations

import asyncio
import http
import logging
from asyncio import TimerHandle
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from tokentape.errors import TokentapeError
from tokentape.server.write_combining import WriteCombiningHttpTools

__all__ = ["ConnectionLimits", "BoundedHttpTools", "bounded_protocol"]

log = logging.getLogger("tokentape.server")

LINGER_SECONDS = 2.0  # after a refusal, how long what the client still sends is read and dropped


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """`tokentape serve`'s --max-header-bytes, --max-headers, --header-timeout, --body-timeout and
    --send-timeout (seconds)."""

    max_header_bytes: int = 64 * 1024  # the request line and headers as sent; as the app's own 431 counts
    max_headers: int = 256
    header_seconds: float = 20.0
    body_seconds: float = 30.0
    send_seconds: float = 30.0


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that is refused."""


class BoundedHttpTools(WriteCombiningHttpTools):
    """uvicorn's httptools protocol within `limits` (`bounded_protocol` makes one with other limits)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request's head (from the connection's opening on)
        self._head_bytes = 0
        self._head_started = False  # a byte of the head came
        self._in_body = False  # the head came, the body has not all come
        self._body_at = 0.0  # when a byte of the body last came
        self._refusal: tuple[int, str, str] | None = None
        self._discarding = False  # refused: what still comes is read and dropped until the close
        self._head_timer: TimerHandle | None = None
        self._body_timer: TimerHandle | None = None
        self._send_timer: TimerHandle | None = None

    # -- the head ----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.limits.header_seconds, self._head_too_slow)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_started = True
        self._head_bytes = 0
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_seconds, self._head_too_slow)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_headers:
            self._refusal = (431, f"a request may carry at most {self.limits.max_headers} headers", "headers")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()
        self._in_body = True

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._discarding or self._refusal is not None or self.parser is None:
            return
        if self._in_head:
            self._head_started = True
        super().data_received(data)
        if self._refusal is not None or self.transport.is_closing():
            return
        if self._in_head:  # what is not yet a whole head counts against its bound
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes", "headers")
        elif self._in_body:
            self._body_at = self.loop.time()
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_seconds, self._body_stalled)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head the parser refused; a head refused here is answered as such."""
        if self._refusal is not None:
            status, message, param = self._refusal
            self._refusal = None
            self._refuse(status, message, param)
        else:
            super().send_400_response(msg)

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if not self._head_started:  # a connection that never sent a byte: closed, nothing to answer
            self._close()
            return
        self._refuse(408, f"the request's headers did not arrive within {self.limits.header_seconds:g} s", "headers")

    def _body_stalled(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or not self._in_body:
            return
        waited = self.loop.time() - self._body_at
        if waited < self.limits.body_seconds or self.flow.read_paused:  # the app is not reading: not the client
            self._body_timer = self.loop.call_later(self.limits.body_seconds - waited, self._body_stalled)
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self._close()
            return
        self._refuse(408, f"the request's body stopped arriving for {self.limits.body_seconds:g} s", None)

    # -- the response ------------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_seconds, self._send_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_stalled(self) -> None:
        """The client read nothing of the response for `send_seconds`: drop the connection (a close
        would wait to write what is buffered); the app sees the client gone."""
        self._send_timer = None
        if self.flow is not None and self.flow.write_paused:
            log.info("a client read nothing for %g s: its connection is dropped", self.limits.send_seconds)
            self.transport.abort()

    # -- the end -----------------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str, param: str | None) -> None:
        """Answer `status` in the shape of the dialect at the request's path, and close."""
        from tokentape.server.dialects.registry import shape_for_path  # the registry imports the server

        error = TokentapeError(message, param=param, code=_CODES[status])
        error.status = status
        url: bytes = getattr(self, "url", b"")  # set when a request begins
        path = url.split(b"?", 1)[0].decode("latin-1")
        payload = orjson.dumps(shape_for_path(path).body(error))
        head = (
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nx-tokentape-error-code: {error.code}\r\nconnection: close\r\n\r\n"
        )
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # the app's answer would go to nobody
            cycle.disconnected = True
            cycle.message_event.set()
        if self.transport.is_closing():
            return
        self.transport.write(head.encode() + payload)
        self._cancel_timers()
        self.headers = []  # what a refused head had sent is let go now, not with the connection
        # the answer, then the end of what is sent; what the client still sends is read and dropped
        # for a moment, so that the answer is read rather than lost to a reset, then the close
        self._in_head = self._in_body = False
        self._discarding = True
        flush = getattr(self.transport, "flush", None)
        if flush is not None:
            flush()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._head_timer = self.loop.call_later(LINGER_SECONDS, self._close)

    def _close(self) -> None:
        self._in_head = self._in_body = False
        self._cancel_timers()
        self.headers = []  # what a refused head had sent is let go now, not with the connection
        if not self.transport.is_closing():
            self.transport.close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        for timer in (self._body_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._body_timer = self._send_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        # uvicorn cancels its keep-alive timer on a clean close only: a reset connection stayed
        # referenced by it (with its last request's headers) until it fired
        self._unset_keepalive_if_required()
        self._cancel_timers()
        self.pipeline.clear()
        self.headers = []


_CODES = {408: "request_timeout", 431: "request_header_fields_too_large"}


def bounded_protocol(limits: ConnectionLimits) -> type[BoundedHttpTools]:
    """The protocol class for uvicorn's `http=` with these limits."""
    return type("BoundedHttpTools", (BoundedHttpTools,), {"limits": limits})

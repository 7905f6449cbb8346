"""uvicorn's httptools protocol with its writes combined: what one turn of the event loop writes to a
connection goes out in one `writev`.

uvicorn writes a response's head as soon as the app starts the response and its body when the app
sends it: two socket writes, two TCP segments, two wake-ups of the client, where the answer is one
message. A stream writes one chunk per event, and the events of one engine read are written in the
same turn. On loopback each write also runs the receiving side of the TCP stack in this process.
Combined: about 0.2 ms less gateway CPU for a whole chat answer and 0.2-0.3 ms for a streamed
16-token one (one agent, ~1k tokens of history, side by side on a 2-core AMD EPYC).

Nothing waits past the turn it was written in: the writes go out from a callback that the loop runs
in its next turn, after a poll that does not wait, behind the callbacks that turn had queued."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["CombinedWrites", "WriteCombiningHttpTools"]

# Past this many bytes held, write now: a large body goes out at once rather than be copied around
FLUSH_AT_BYTES = 256 << 10


class CombinedWrites:
    """A transport whose `write`s are held until the loop's next turn and then written together.
    Everything else is the wrapped transport's; `close` writes what is held first."""

    __slots__ = ("_held", "_held_bytes", "_loop", "_queued", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: list[bytes | bytearray | memoryview] = []
        self._held_bytes = 0
        self._queued = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._held.append(data)
        self._held_bytes += len(data)
        if self._held_bytes >= FLUSH_AT_BYTES:
            self.flush()
        elif not self._queued:
            self._queued = True
            self._loop.call_soon(self._flush_queued)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _flush_queued(self) -> None:
        self._queued = False
        self.flush()

    def flush(self) -> None:
        """Write what is held now (dropped once the connection is closing: nobody would read it)."""
        held = self._held
        if not held:
            return
        self._held = []
        self._held_bytes = 0
        if self.transport.is_closing():
            return
        if len(held) == 1:
            self.transport.write(held[0])
        else:
            self.transport.writelines(held)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self._held = []
        self._held_bytes = 0
        self.transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class WriteCombiningHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol (`uvicorn.Config(http=...)`), writing through `CombinedWrites`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        combined = CombinedWrites(transport, self.loop)
        super().connection_made(combined)  # type: ignore[arg-type]

"""How the embedded engine's worker thread hands a generation's items to the caller's event loop.

Every hand-off wakes the loop: a write to its self-pipe, a thread switch, the loop's own work. On a
machine whose cores all run the decode threads, that wake-up takes a core from one of them, and
ggml's threads wait at their next barrier for it. A caller that reads only the whole answer (no
stream, no stop string to watch) gets its tokens in chunks instead: one wake-up per `chunk` tokens,
and one for the end, an error or anything that is not a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from tokentape.engines.base import SampledToken

__all__ = ["WHOLE_ANSWER_CHUNK", "Handoff"]

# Tokens handed over at once to a caller that reads the whole answer. Each chunk is kept when a
# weight update cuts the generation; what the worker sampled past the last chunk is sampled again
# under the new weights, as a streamed generation's next token is.
WHOLE_ANSWER_CHUNK = 16


class Handoff:
    """A queue from the worker thread to one event loop, of lists of items."""

    def __init__(self, loop: asyncio.AbstractEventLoop, chunk: int = 1) -> None:
        self.queue: asyncio.Queue[list[object]] = asyncio.Queue()
        self.wakeups = 0
        self._loop = loop
        self._chunk = chunk
        self._held: list[object] = []
        self._lock = threading.Lock()  # the worker puts; a revived worker may fail what the dead one held

    def put(self, item: object) -> None:
        """From any thread: hand `item` over, or hold it until `chunk` tokens are held."""
        with self._lock:
            self._held.append(item)
            if isinstance(item, SampledToken) and len(self._held) < self._chunk:
                return
            items, self._held = self._held, []
            self.wakeups += 1
        with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens
            self._loop.call_soon_threadsafe(self.queue.put_nowait, items)

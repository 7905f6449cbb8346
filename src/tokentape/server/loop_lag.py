"""How long the event loop was held: a ticker coroutine that sleeps a fixed step and times how late it
woke. Whatever held the loop in between (a render, a tokenizer call that keeps the GIL, an image
decoded in line) held every other request with it, `/health` included; each late wake-up is one
observation of `tokentape_event_loop_lag_seconds` on `/metrics`, and the longest since the server
started is `tokentape_event_loop_lag_max_seconds`.

A step of 50 ms costs the loop one wake-up per step (about 20 us); a hold shorter than a step is seen
only in part, one longer than a step whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

__all__ = ["LOOP_LAG_STEP", "watch_loop_lag"]

LOOP_LAG_STEP = 0.05  # seconds between wake-ups


@contextlib.asynccontextmanager
async def watch_loop_lag(observe: Callable[[float], None], step: float = LOOP_LAG_STEP) -> AsyncIterator[None]:
    """Run the ticker on the running loop while the block runs; `observe` gets each wake-up's lag
    (seconds later than asked)."""

    async def tick() -> None:
        clock = time.monotonic
        while True:
            asked = clock() + step
            await asyncio.sleep(step)
            observe(max(0.0, clock() - asked))

    task = asyncio.create_task(tick(), name="tokentape-loop-lag")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

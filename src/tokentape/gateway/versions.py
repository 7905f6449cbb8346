"""The gateway's clock of weights versions and the generations running against it.

Every generation enters through `enter()` (it waits while generation is held, then pins the version
it will be sampled under, read once) and leaves when its engine stream is closed. A weight update
holds new generations (`hold`), marks a seam (`seam`: running generations stop at their next token
boundary, or at once if they are waiting for the engine) and waits until none is in an engine
(`quiet`), so engines are paused with nothing running on them and no request is ever served while
engines hold different weights.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from tokentape.engines.weights import InFlight

__all__ = ["Cuttable", "Pin", "VersionGate"]


@dataclass(frozen=True, slots=True)
class Pin:
    """What a generation read when it was dispatched: its version, and the epochs it watches."""

    version: int
    label: str | None
    seam_epoch: int
    abort_epoch: int


class Cuttable(Protocol):
    waiting_whole: bool

    def cut(self) -> None: ...


class VersionGate:
    def __init__(self) -> None:
        self._version = 0
        self._bumped = asyncio.Event()  # set (and replaced) each time the version changes
        self.label: str | None = None  # the free-form label recorded on each turn
        self.running = asyncio.Event()
        self.running.set()
        # an operator's /admin/pause: a weight update that lands meanwhile leaves the gateway held
        self.operator_hold = False
        self.seam_epoch = 0  # bumped by an update that lets turns go on (continue, keep)
        self.seam_mode: InFlight = "continue"
        self.abort_epoch = 0  # bumped by an update (or pause) that ends running turns
        self.at_engine: set[Cuttable] = set()  # generations waiting for the engine's next token
        # seconds each turn stopped at a seam waited before it generated on (the latest 10,000)
        self.seam_waits: deque[float] = deque(maxlen=10_000)
        self._in_engine = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, version: int) -> None:
        if version != self._version:
            self._version = version
            self._bumped.set()  # wakes whoever waits for a new version
            self._bumped = asyncio.Event()

    async def next_version(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the version to change; whether it did."""
        bumped = self._bumped
        try:
            await asyncio.wait_for(bumped.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def enter(self) -> Pin:
        while not self.running.is_set():  # re-checked: a hold may come between the wake-up and here
            await self.running.wait()
        self._in_engine += 1
        self._idle.clear()
        return Pin(self.version, self.label, self.seam_epoch, self.abort_epoch)

    def leave(self) -> None:
        self._in_engine -= 1
        if self._in_engine == 0:
            self._idle.set()

    def hold(self) -> None:
        self.running.clear()

    def release(self) -> None:
        self.running.set()

    def seam(self, mode: InFlight) -> None:
        """Running generations stop at their next token boundary; those waiting for the engine now."""
        self.seam_epoch += 1
        self.seam_mode = mode
        for run in list(self.at_engine):
            run.cut()

    def abort(self) -> None:
        """Running generations end at their next token (finish reason abort); one waiting for its whole
        answer has shown nothing yet, so it is cut and goes on once generation resumes."""
        self.abort_epoch += 1
        for run in list(self.at_engine):
            if run.waiting_whole:
                run.cut()

    async def quiet(self) -> None:
        """Until no generation is in an engine."""
        await self._idle.wait()

"""How many threads the embedded engine's steps use, learnt from how long its steps take.

ggml's threads meet at a barrier after every operation of a step. On a machine with a core to spare
every core is fastest (1.7x one fewer, on 2 cores); on one where anything else computes, a thread that
has to share its core holds up every barrier, and a step takes several times as long (measured on 2
cores beside one busy core: 11 tokens/s with 2 threads against 70 with 1). Neither setting is right
everywhere, and the load changes while a server runs. So the engine runs its steps with the setting
that has been faster lately, and now and then runs one step with the other to check: a step is
compared with the latest step of the same number of rows under the chosen setting. Pure bookkeeping;
the worker applies what it says.
"""

from __future__ import annotations

import math

__all__ = ["ThreadTuner"]


class ThreadTuner:
    """Chooses between `low` and `high` threads for each step."""

    def __init__(
        self, low: int, high: int, *, explore_every: int = 48, first_explore: int = 4, smoothing: float = 0.3
    ) -> None:
        if not 1 <= low < high:
            raise ValueError("the tuner chooses between a smaller and a larger count of threads")
        self.low, self.high = low, high
        self.chosen = low  # the safe one until the other has shown itself faster
        self.explore_every = explore_every
        self.first_explore = first_explore
        self.smoothing = smoothing
        self.steps = 0
        self.explored = 0
        # smoothed log(seconds with high / seconds with low), over pairs of steps of the same rows
        self.log_ratio: float | None = None
        self._latest: dict[tuple[int, int], float] = {}  # (threads, rows) -> seconds of the latest such step

    @property
    def other(self) -> int:
        return self.low if self.chosen == self.high else self.high

    def threads_for(self, rows: int) -> int:
        """The threads for the next step, of `rows` rows: the chosen setting, or now and then the
        other one, when a step of as many rows under the chosen setting is there to compare with."""
        self.steps += 1
        due = self.steps % self.explore_every == self.first_explore % self.explore_every
        if due and (self.chosen, rows) in self._latest:
            self.explored += 1
            return self.other
        return self.chosen

    def record(self, threads: int, rows: int, seconds: float) -> None:
        """A step of `rows` rows took `seconds` with `threads`."""
        self._latest[(threads, rows)] = seconds
        if threads == self.chosen or seconds <= 0.0:
            return
        reference = self._latest.get((self.chosen, rows))
        if reference is None or reference <= 0.0:
            return
        high, low = (seconds, reference) if threads == self.high else (reference, seconds)
        sample = math.log(high / low)
        self.log_ratio = (
            sample if self.log_ratio is None else (1 - self.smoothing) * self.log_ratio + (self.smoothing * sample)
        )
        self.chosen = self.high if self.log_ratio < 0.0 else self.low

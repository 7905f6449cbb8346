"""Incremental text of sampled tokens: UTF-8 split across tokens, and stop strings split across deltas."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["TextAssembler", "StopStringFilter"]


class TextAssembler:
    """Turns the bytes of successive tokens into text, holding back incomplete UTF-8 sequences."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def finish(self) -> str:
        """Whatever is still held back, with a broken trailing sequence replaced by U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopStringFilter:
    """Passes text through until a stop string appears; the stop string itself is never emitted.

    Text that could still become the start of a stop string is held back until it is decided.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)]
        hold = self._longest_partial_stop(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def finish(self) -> str:
        """Release held text at the end of generation (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial_stop(self, buffer: str) -> int:
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best

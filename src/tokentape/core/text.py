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
        # most tokens are ASCII: with nothing held back they are their own text, without the
        # decoder's Python-level buffering (a token's share of a long answer's cost)
        if not self._decoder.buffer and piece.isascii():
            return piece.decode("ascii")
        return self._decoder.decode(piece)

    def finish(self) -> str:
        """Whatever is still held back, with a broken trailing sequence replaced by U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopStringFilter:
    """Passes text through until a stop string appears; the stop string itself is never emitted.

    The text is cut where the earliest stop string in it begins (OpenAI's semantics), wherever the
    deltas split: with stops `["bcd", "c"]`, "abcd" gives "a" whole and one character at a time.
    So text that could still become the start of a stop string is held back until it is decided,
    and a complete match is final only once no stop string that starts earlier can still complete.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if not self._stops:
            return text
        if self.stopped:
            return ""
        buffer = self._held + text
        match = self._earliest_match(buffer)
        undecided = self._earliest_partial(buffer, before=len(buffer) if match is None else match)
        if match is not None and undecided is None:
            self.stopped = True
            self._held = ""
            return buffer[:match]
        keep = len(buffer) if undecided is None else undecided
        self._held = buffer[keep:]
        return buffer[:keep]

    def finish(self) -> str:
        """Release held text at the end of generation, cut at a stop string it holds."""
        held, self._held = self._held, ""
        if self.stopped:
            return ""
        match = self._earliest_match(held)
        if match is not None:
            self.stopped = True
            return held[:match]
        return held

    def _earliest_match(self, buffer: str) -> int | None:
        hits = [i for i in (buffer.find(stop) for stop in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _earliest_partial(self, buffer: str, *, before: int) -> int | None:
        """The earliest position before `before` where a stop string starts but runs past the end."""
        for start in range(max(0, len(buffer) - max((len(s) for s in self._stops), default=0)), before):
            tail = buffer[start:]
            if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self._stops):
                return start
        return None

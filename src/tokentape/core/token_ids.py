"""A prompt's token IDs with their JSON text written once, and on a session's path only in part.

A prompt is written as JSON for the engine (once per choice) and, where the response shows it
(`--prompt-token-ids always`, the default), once more for the client: the same IDs each time, which
at 128k tokens of history cost about 0.5 ms a writing. `PromptIds` keeps the text of the first.

A later call's prompt is the previous prompt, its reply, and a few new tokens. Each session keeps the
text of the latest prompt it sent an engine (`PathText`), so the next one on the same path writes
only the IDs after it; a session's first prompt hands its text on once it is recorded
(`FirstPromptIds`), so its second does too. The text stands for the first IDs of a tape buffer
(`TurnNode.path_buffer`), which only ever grows: what was written of it stays true, whichever turn
extends it."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy
import orjson

__all__ = ["FirstPromptIds", "PathText", "PathTextSlot", "PromptIds"]

if TYPE_CHECKING:
    _IntArray = array[int]
else:
    _IntArray = array  # not subscriptable at run time before Python 3.12


@dataclass(frozen=True, slots=True)
class PathText:
    """A prompt's JSON text whose first `cut` bytes write `buffer[:count]` (an unclosed "[1,2,3")."""

    buffer: array[int]
    count: int
    text: bytes
    cut: int


class PathTextSlot:
    """Where a session keeps the text of its latest prompt on the tape (one, whatever its branches)."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: PathText | None = None

    @property
    def held_bytes(self) -> int:
        return len(self.entry.text) if self.entry is not None else 0

    def clear(self) -> None:
        self.entry = None

    def write(self, ids: array[int], buffer: array[int], count: int) -> bytes:
        """The JSON of `ids`, whose first `count` are `buffer[:count]`: the entry's text as far as it
        goes, then the IDs after it. The result becomes the entry."""
        view = numpy.frombuffer(ids, dtype=numpy.int32)
        known = self.entry
        parts: list[bytes | memoryview]
        if known is not None and known.buffer is buffer and known.count <= count:
            parts, written = [memoryview(known.text)[: known.cut]], known.count
        else:
            parts, written = [b"["], 0
        written = _append(parts, view[written:count], written)
        cut = sum(map(len, parts))
        _append(parts, view[count:], written)
        parts.append(b"]")
        text = b"".join(parts)
        self.entry = PathText(buffer, count, text, cut)
        return text


def _append(parts: list[bytes | memoryview], ids: numpy.ndarray, written: int) -> int:
    """Add `ids` to an unclosed JSON array that holds `written` IDs; the count it then holds."""
    if len(ids):
        parts += [b",", _inner(ids)] if written else [_inner(ids)]
    return written + len(ids)


def _inner(ids: numpy.ndarray) -> memoryview:
    """IDs as JSON without the brackets; written in C by orjson, without one Python int each."""
    return memoryview(orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY))[1:-1]


class PromptIds(_IntArray):
    """int32 token IDs (an `array('i')`) whose JSON text is made once, on first use. The IDs are not
    to be changed after that: the text is checked against their count, not their values."""

    __slots__ = ("_json", "_path")
    _json: tuple[int, orjson.Fragment]
    _path: tuple[PathTextSlot, array[int], int]

    def __new__(cls, ids: Iterable[int] = ()) -> PromptIds:
        # another int32 array is copied whole, not token by token
        return super().__new__(cls, "i", ids)  # type: ignore[return-value]  # typeshed: array[int]

    def on_path(self, slot: PathTextSlot, buffer: array[int], count: int) -> PromptIds:
        """Mark the first `count` IDs as `buffer[:count]`: the text then comes from, and goes to, `slot`."""
        self._path = (slot, buffer, count)
        return self

    def json(self, *, keep: bool = False) -> orjson.Fragment:
        """The IDs as a JSON array, to embed in a body `orjson` writes. `keep`: written from, and kept
        in, the session's slot (`on_path`); the engine's body asks for that, being written before its
        turn is counted against the session's memory, where a response is written after."""
        made: tuple[int, orjson.Fragment] | None = getattr(self, "_json", None)
        if made is None or made[0] != len(self):
            path: tuple[PathTextSlot, array[int], int] | None = getattr(self, "_path", None) if keep else None
            if path is not None and path[2] <= len(self):
                text = path[0].write(self, path[1], path[2])
            else:
                text = orjson.dumps(numpy.frombuffer(self, dtype=numpy.int32), option=orjson.OPT_SERIALIZE_NUMPY)
            made = self._json = (len(self), orjson.Fragment(text))
        return made[1]


class FirstPromptIds(list[int]):
    """A session's first prompt: its token IDs as the tokenizer gave them (a list: made an int32 array,
    115k IDs would cost 2-4 ms), with their JSON text written once, for the engine and the response.
    Once the turn is recorded at the start of a tape buffer, the text the engine was sent becomes the
    session's (`hand_on`): the second prompt, that buffer's first IDs and a few more, then writes only
    the IDs after them (0.8-0.9 ms less at 115k tokens, as measured side by side)."""

    __slots__ = ("_json", "_sent")
    _json: tuple[int, orjson.Fragment, bytes]
    _sent: bool

    def json(self, *, keep: bool = False) -> orjson.Fragment:
        """The IDs as a JSON array, to embed in a body `orjson` writes; `keep`: an engine's body, whose
        text the session may keep once the turn is recorded."""
        made: tuple[int, orjson.Fragment, bytes] | None = getattr(self, "_json", None)
        if made is None or made[0] != len(self):
            text = orjson.dumps(self)
            made = self._json = (len(self), orjson.Fragment(text), text)
        if keep:
            self._sent = True
        return made[1]

    def __reduce__(self) -> tuple[type[FirstPromptIds], tuple[list[int]]]:
        return FirstPromptIds, (list(self),)  # the IDs alone: the text stays with the process that wrote it

    def hand_on(self, slot: PathTextSlot, buffer: array[int]) -> None:
        """The turn of this prompt is recorded with these IDs as `buffer`'s first: if an engine was sent
        their text, `slot` keeps it (a session that never sends an engine JSON keeps none)."""
        made: tuple[int, orjson.Fragment, bytes] | None = getattr(self, "_json", None)
        if made is None or made[0] != len(self) or not getattr(self, "_sent", False) or len(buffer) < len(self):
            return
        text = made[2]
        slot.entry = PathText(buffer, len(self), text, len(text) - 1)

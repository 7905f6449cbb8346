"""A prompt's token IDs with their JSON text written once.

A prompt is written as JSON for the engine (once per choice) and, where the response shows it
(`--prompt-token-ids always`, the default), once more for the client: the same IDs each time, which
at 128k tokens of history cost about 0.6 ms a writing. `PromptIds` keeps the text of the first."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy
import orjson

__all__ = ["PromptIds"]

if TYPE_CHECKING:
    _IntArray = array[int]
else:
    _IntArray = array  # not subscriptable at run time before Python 3.12


class PromptIds(_IntArray):
    """int32 token IDs (an `array('i')`) whose JSON text is made once, on first use. The IDs are not
    to be changed after that: the text is checked against their count, not their values."""

    __slots__ = ("_json",)
    _json: tuple[int, orjson.Fragment]

    def __new__(cls, ids: Iterable[int] = ()) -> PromptIds:
        # another int32 array is copied whole, not token by token
        return super().__new__(cls, "i", ids)  # type: ignore[return-value]  # typeshed: array[int]

    def json(self) -> orjson.Fragment:
        """The IDs as a JSON array, to embed in a body `orjson` writes."""
        made: tuple[int, orjson.Fragment] | None = getattr(self, "_json", None)
        if made is None or made[0] != len(self):
            # seen as numpy, orjson writes the IDs in C without one Python int each
            ids = numpy.frombuffer(self, dtype=numpy.int32)
            made = self._json = (len(self), orjson.Fragment(orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY)))
        return made[1]

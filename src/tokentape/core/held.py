"""One account of the bytes the gateway holds for what clients sent, by kind, and the estimate that
bounds what a parse of JSON holds.

Every holder that keeps something a request carried past the request (sessions' tapes, the template
inputs each turn records, the parses kept to reuse, the conversations kept for `previous_response_id`,
image bytes, retry records) reports its bytes here under its kind. The budget (`--max-memory-bytes`)
is checked against the total, and the same figures are what `/metrics` shows per kind; what a kind
may give up when the total is past the budget (a cache) it gives up through `shed`.

`parsed_bytes` bounds what orjson's parse of a JSON text holds in Python objects from the text alone,
at C speed (one copy without the structural bytes and two searches: 2.5 ms for 2 MB, where a count
of each structural byte took 10): the text's length, times 4 where a string may be stored at 4 bytes a
character (any non-ASCII byte or `\\u` escape in the text), plus `BYTES_PER_STRUCTURE` for each
`{`, `[`, `,` and `:` (each value, key and container is announced by one of them). Measured with
tracemalloc on CPython 3.11 and orjson 3.13 (what a parse kept, less the text's share), the costliest
shapes per structural character: objects of one short string value 77 bytes, nested empty objects 71,
one-character strings 54 (non-ASCII 62), messages of 200 characters 53, empty objects 35, empty
lists 31, numbers 6-24. A text of empty objects holds 24 times its length; the estimate says 65.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BYTES_PER_STRUCTURE", "HeldBytes", "parsed_bytes"]

BYTES_PER_STRUCTURE = 96  # above the costliest shape measured (77 bytes), with a margin for other builds


def parsed_bytes(text: bytes | bytearray) -> int:
    """A bound on the bytes of Python objects `orjson.loads(text)` holds (see the module's figures)."""
    structures = len(text) - len(text.translate(None, b"{[,:")) + 1
    # a string may then hold up to 4 bytes a character (a backslash looked for first: memchr's speed,
    # and many texts have none)
    wide = not text.isascii() or (b"\\" in text and b"\\u" in text)
    return (4 if wide else 1) * len(text) + BYTES_PER_STRUCTURE * structures


@dataclass(frozen=True, slots=True)
class _Kind:
    held: Callable[[], int]
    shed: Callable[[int], int] | None  # give up at least this many bytes if it can; the bytes freed


class HeldBytes:
    """The kinds of what the gateway holds, each read when asked (`by_kind`, `total`). A kind with a
    `shed` is a cache: past the budget it gives up bytes before any session leaves memory."""

    def __init__(self, budget: int = 0) -> None:
        self._kinds: dict[str, _Kind] = {}
        self.budget = budget  # the bytes the total is held to (0: none known), for holders that size by it

    def add(self, kind: str, held: Callable[[], int], shed: Callable[[int], int] | None = None) -> None:
        """Count `held()` under `kind` (one holder a kind: adding it again replaces the last)."""
        self._kinds[kind] = _Kind(held, shed)

    def by_kind(self) -> dict[str, int]:
        return {kind: entry.held() for kind, entry in self._kinds.items()}

    def total(self) -> int:
        return sum(entry.held() for entry in self._kinds.values())

    def shed(self, wanted: int) -> int:
        """Ask the caches to give up `wanted` bytes between them, in the order they were added; the
        bytes freed."""
        freed = 0
        for entry in self._kinds.values():
            if freed >= wanted:
                break
            if entry.shed is not None:
                freed += entry.shed(wanted - freed)
        return freed

"""Which KV cache slot a new generation of the embedded engine runs in, and what of its prompt it
may skip: pure bookkeeping, no llama.cpp.

Every slot is one llama.cpp sequence id of a KV cache shared by all of them. A slot remembers the
tokens its KV holds, the weights version that computed them, the session that last used it and
when. A generation gets its session's own slot if it has one, else an empty one, else the least
recently used idle one; it then skips the longest prefix it shares with any slot's KV computed under
the current weights: its own (a session's next turn: prefill only the bridge and the new messages),
or another slot's, copied in (n > 1 choices of one prompt, a group of episodes on one question).
The last prompt token is always evaluated, for its logits.

An idle slot's KV may be held in host memory instead of the cache (`Slot.stored`, set by the batcher):
it still counts as the session's, is put back before its session's next turn, but is no source to copy
from and no cells to evict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Assignment", "Slot", "SlotTable", "shared_prefix"]


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


@dataclass(slots=True)
class Slot:
    seq_id: int
    tokens: list[int] = field(default_factory=list)  # what its KV holds, position 0 on
    version: int = 0  # the weights version that computed that KV
    session: str | None = None
    last_used: int = 0
    busy: bool = False
    stored: Any = None  # its KV saved to host memory (llama.cpp's sequence state) while out of the cache


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where a generation runs: `slot`, first cut to its own first `keep` tokens; then, when `source`
    is set, that slot's first `copy` tokens copied in (llama.cpp shares the cells, nothing is
    recomputed). The generation prefills its prompt from `reused` on."""

    slot: Slot
    keep: int
    source: Slot | None
    copy: int

    @property
    def reused(self) -> int:
        return self.copy if self.source is not None else self.keep


class SlotTable:
    def __init__(self, count: int) -> None:
        self.slots = [Slot(seq_id) for seq_id in range(count)]
        self._clock = 0

    def idle(self) -> list[Slot]:
        return [s for s in self.slots if not s.busy]

    def best_source(self, prompt: Sequence[int], version: int) -> tuple[Slot | None, int]:
        """The slot whose current-version KV shares the longest prefix with `prompt` (at most all of it
        but its last token), and that length."""
        best: Slot | None = None
        length = 0
        for slot in self.slots:
            if slot.version != version or not slot.tokens or slot.stored is not None:
                continue
            shared = min(shared_prefix(slot.tokens, prompt), len(prompt) - 1)
            if shared > length:
                best, length = slot, shared
        return best, length

    def target(self, session: str | None) -> Slot | None:
        """The idle slot a generation of `session` takes: its own, an empty one, the least recently used."""
        idle = self.idle()
        if not idle:
            return None
        if session is not None:
            for slot in idle:
                if slot.session == session:
                    return slot
        empty = [s for s in idle if not s.tokens]
        if empty:
            return empty[0]
        return min(idle, key=lambda s: s.last_used)

    def assign(self, prompt: Sequence[int], session: str | None, version: int) -> Assignment | None:
        """Take a slot for `prompt` (None: every slot is busy). The slot is marked busy and its
        bookkeeping set to what the KV will hold once the caller has cut and copied as told."""
        slot = self.target(session)
        if slot is None:
            return None
        own = min(shared_prefix(slot.tokens, prompt), len(prompt) - 1) if slot.version == version else 0
        source, length = self.best_source(prompt, version)
        assignment = Assignment(slot, own, source if source is not slot and length > own else None, length)
        slot.busy = True
        slot.session = session
        slot.version = version
        slot.tokens = list(prompt[: assignment.reused])
        return assignment

    def release(self, slot: Slot) -> None:
        """The generation in `slot` is over; its KV stays cached for the session's next turn."""
        self._clock += 1
        slot.busy = False
        slot.last_used = self._clock

    def evict(self) -> Slot | None:
        """Empty the least recently used idle slot that holds KV in the cache (for room in it)."""
        holding = [s for s in self.slots if not s.busy and s.tokens and s.stored is None]
        if not holding:
            return None
        slot = min(holding, key=lambda s: s.last_used)
        slot.tokens = []
        slot.session = None
        return slot

"""Idle slots' KV out of the cache while a long prompt is read, and back for its session's next turn.

llama.cpp attends every row of a step over every cell up to the highest one in use and masks the cells
of other sequences; flash attention skips their arithmetic but still walks their mask, per row, head
and layer, so a prompt read beside 12k cells of sessions between turns took 2-4x as long as in an empty
cache. When a generation starts with at least `OFFLOAD_FROM` prompt tokens to compute, every idle
slot's KV is copied to host memory (llama.cpp's sequence state: the cells as they are, so nothing is
recomputed and the logits of the session's next turn are bit for bit the same) and cut from the cache,
as llama-server does with idle slots (`--cache-ram`); it is put back when its session's next turn
starts. Host memory holds at most `stored_tokens` tokens of it (the oldest dropped first, to be
recomputed if their session comes back). Part of the batching worker (`engines.batching.Batcher`),
run on its thread.
"""

from __future__ import annotations

import logging

from tokentape.engines.llama_context import Native
from tokentape.engines.slots import SlotTable

__all__ = ["OFFLOAD_FROM", "KvOffload"]

log = logging.getLogger("tokentape.engine")

# a generation with this many prompt tokens to compute moves idle slots' KV out of the cache first
OFFLOAD_FROM = 256


class KvOffload:
    """The batching worker's idle KV in host memory (`stored_tokens` of it at most; 0: none leaves
    the cache)."""

    native: Native
    slots: SlotTable
    version: int  # the weights version new KV is computed under
    stored_tokens: int
    offloaded: int  # idle slots' KV moved to host memory
    restored: int  # and put back for its session's next turn

    def _bring_back(self, session: str | None) -> None:
        """The slot a generation of `session` is about to take holds its KV in the cache again: put
        back when it is the session's own, else forgotten (it is cut anyway)."""
        slot = self.slots.target(session)
        if slot is None or slot.stored is None:
            return
        data, slot.stored = slot.stored, None
        if session is not None and slot.session == session and slot.version == self.version:
            while not self.native.restore(slot.seq_id, data):
                evicted = self.slots.evict()  # no room: the least recently used idle KV in the cache goes
                if evicted is None:
                    break
                self.native.cut(evicted.seq_id, 0)
            else:
                self.restored += 1
                return
        self.native.cut(slot.seq_id, 0)  # what a failed restore left
        slot.tokens = []

    def _offload_idle(self) -> None:
        """Move every idle slot's KV from the cache to host memory, within `stored_tokens` (the least
        recently used first out of host memory, the most recently used first into it)."""
        idle = sorted(
            (s for s in self.slots.slots if not s.busy and s.tokens and s.stored is None),
            key=lambda s: -s.last_used,
        )
        for slot in idle:
            if len(slot.tokens) > self.stored_tokens:
                continue  # stays in the cache
            self._trim_stored(self.stored_tokens - len(slot.tokens), newer_than=slot.last_used)
            if self._stored() + len(slot.tokens) > self.stored_tokens:
                break  # only newer KV is held: this and older stay in the cache
            try:
                slot.stored = self.native.save(slot.seq_id)
            except RuntimeError as exc:  # it stays in the cache
                log.warning("an idle slot's KV could not be saved to host memory: %s", exc)
                continue
            self.native.cut(slot.seq_id, 0)
            self.offloaded += 1

    def _stored(self) -> int:
        return sum(len(s.tokens) for s in self.slots.slots if s.stored is not None)

    def _trim_stored(self, room: int, *, newer_than: int) -> None:
        """Forget stored KV, oldest first, older than `newer_than`, until at most `room` tokens are held."""
        held = sorted((s for s in self.slots.slots if s.stored is not None), key=lambda s: s.last_used)
        total = sum(len(s.tokens) for s in held)
        for slot in held:
            if total <= room or slot.last_used >= newer_than:
                return
            total -= len(slot.tokens)
            slot.stored, slot.tokens, slot.session = None, [], None

"""The embedded engine's KV slot bookkeeping: which slot a generation takes and what it may skip."""

from __future__ import annotations

from tokentape.engines.slots import SlotTable


def _run(table: SlotTable, prompt: list[int], session: str | None, version: int = 0) -> tuple[int, int, int | None]:
    """Assign, then release as a generation that fed its whole prompt would; (slot, reused, source)."""
    assignment = table.assign(prompt, session, version)
    assert assignment is not None
    slot = assignment.slot
    source = None if assignment.source is None else assignment.source.seq_id
    reused = assignment.reused
    slot.tokens = list(prompt)
    table.release(slot)
    return slot.seq_id, reused, source


def test_a_session_gets_its_own_slot_back_and_skips_what_it_holds() -> None:
    table = SlotTable(3)
    first, _, _ = _run(table, [1, 2, 3, 4], "a")
    _run(table, [9, 9, 9], "b")
    slot, reused, source = _run(table, [1, 2, 3, 4, 5, 6], "a")
    assert (slot, reused, source) == (first, 4, None)


def test_the_last_prompt_token_is_always_evaluated() -> None:
    table = SlotTable(2)
    _run(table, [1, 2, 3], "a")
    assert _run(table, [1, 2, 3], "a")[1] == 2


def test_another_slots_prefix_is_copied_not_taken() -> None:
    table = SlotTable(3)
    owner, _, _ = _run(table, [5, 6, 7, 8], "a")
    slot, reused, source = _run(table, [5, 6, 7, 1], "b")
    assert slot != owner and (reused, source) == (3, owner)
    assert table.slots[owner].tokens == [5, 6, 7, 8]  # a's cache is untouched


def test_kv_of_other_weights_is_never_reused() -> None:
    table = SlotTable(2)
    _run(table, [1, 2, 3, 4], "a", version=0)
    assert _run(table, [1, 2, 3, 4, 5], "a", version=1)[1:] == (0, None)


def test_the_least_recently_used_idle_slot_is_taken_and_evicted_first() -> None:
    table = SlotTable(2)
    a, _, _ = _run(table, [1, 1], "a")
    b, _, _ = _run(table, [2, 2], "b")
    _run(table, [1, 1, 1], "a")  # a used again: b is now the least recently used
    assert _run(table, [3, 3], "c")[0] == b
    evicted = table.evict()
    assert evicted is not None and evicted.seq_id == a and evicted.tokens == []


def test_busy_slots_are_neither_taken_nor_evicted() -> None:
    table = SlotTable(1)
    running = table.assign([1, 2], "a", 0)
    assert running is not None
    assert table.assign([3, 4], "b", 0) is None
    assert table.evict() is None


def test_kv_held_in_host_memory_is_no_copy_source_and_no_cells_to_evict() -> None:
    table = SlotTable(3)
    owner, _, _ = _run(table, [5, 6, 7, 8], "a")
    table.slots[owner].stored = b"kv"  # out of the cache (the batcher saved and cut it)
    slot, reused, source = _run(table, [5, 6, 7, 1], "b")
    assert slot != owner and (reused, source) == (0, None)
    evicted = table.evict()
    assert evicted is not None and evicted.seq_id == slot  # b's, in the cache; a's stays a's
    assert table.slots[owner].tokens == [5, 6, 7, 8] and table.evict() is None

"""The one cache type: bounded by the bytes its owner counts and by entries, least recently used out
first, a value larger than the budget never kept."""

from __future__ import annotations

from tokentape.core.bounded import BoundedCache


def test_bytes_bound_drops_the_least_recently_used() -> None:
    cache: BoundedCache[str, bytes] = BoundedCache(10, len)
    cache.put("a", b"xxxx")
    cache.put("b", b"xxxx")
    assert cache.get("a") == b"xxxx"  # now b is the least recently used
    cache.put("c", b"xxxx")
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (b"xxxx", None, b"xxxx")
    assert cache.held_bytes == 8 and cache.dropped == 1


def test_replacing_a_value_counts_only_the_new_one() -> None:
    cache: BoundedCache[str, bytes] = BoundedCache(10, len)
    cache.put("a", b"x" * 6)
    cache.put("a", b"x" * 2)
    assert cache.held_bytes == 2 and len(cache) == 1


def test_a_value_past_the_budget_is_not_kept_and_evicts_nothing() -> None:
    cache: BoundedCache[str, bytes] = BoundedCache(10, len)
    cache.put("a", b"x" * 5)
    cache.put("huge", b"x" * 11)
    assert cache.get("huge") is None and cache.get("a") == b"x" * 5 and cache.held_bytes == 5


def test_the_entry_bound_holds_too() -> None:
    cache: BoundedCache[int, int] = BoundedCache(1 << 30, lambda _: 1, max_items=3)
    for n in range(10):
        cache.put(n, n)
    assert len(cache) == 3 and [cache.get(n) for n in range(7, 10)] == [7, 8, 9] and cache.get(6) is None


def test_a_smaller_bound_drops_the_least_recently_used_at_once() -> None:
    cache: BoundedCache[str, bytes] = BoundedCache(10, len)
    cache.put("a", b"xxxx")
    cache.put("b", b"xxxx")
    assert cache.get("a") == b"xxxx"
    cache.resize(5)
    assert cache.get("b") is None and cache.get("a") == b"xxxx" and cache.held_bytes == 4
    cache.resize(0)
    assert len(cache) == 0 and cache.held_bytes == 0

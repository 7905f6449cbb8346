"""One cache type for everything the process keeps on the side: bounded by what it holds (bytes, as
its owner counts them) and by entries, least recently used dropped first. Render answers (processed
pixel tensors, megabytes each) and decoded-image facts (a few bytes each) are the same structure
with other sizes: one type, one rule, one place to look when memory grows."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BoundedCache"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """At most `max_bytes` (as `size_of` counts each value) and `max_items`. A value larger than
    the whole budget is not kept. Thread-safe: the image checks run on worker threads."""

    def __init__(self, max_bytes: int, size_of: Callable[[V], int], *, max_items: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._size_of = size_of
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.held_bytes = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                return None
            self._items.move_to_end(key)
            return found[0]

    def discard(self, key: K) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.held_bytes -= old[1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.held_bytes = 0

    def resize(self, max_bytes: int) -> None:
        """A new bound; what is past it leaves now, least recently used first."""
        with self._lock:
            self.max_bytes = max_bytes
            self._shrink()

    def shed(self, wanted: int) -> int:
        """Drop the least recently used values until `wanted` bytes are freed or none is left; the
        bytes freed."""
        freed = 0
        with self._lock:
            while self._items and freed < wanted:
                _, (_, dropped) = self._items.popitem(last=False)
                self.held_bytes -= dropped
                self.dropped += 1
                freed += dropped
        return freed

    def put(self, key: K, value: V) -> None:
        size = self._size_of(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.held_bytes -= old[1]
            if size > self.max_bytes:
                return
            self._items[key] = (value, size)
            self.held_bytes += size
            self._shrink()

    def _shrink(self) -> None:
        while self._items and (
            self.held_bytes > self.max_bytes or (self.max_items is not None and len(self._items) > self.max_items)
        ):
            _, (_, dropped) = self._items.popitem(last=False)
            self.held_bytes -= dropped
            self.dropped += 1

"""`parsed_bytes` bounds what orjson's parse of a text holds, measured here with tracemalloc for the
shapes that cost the most per byte and for any JSON Hypothesis writes; `HeldBytes` sums its kinds and
asks its caches, in order, to give bytes up."""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from tokentape.core.held import HeldBytes, parsed_bytes

N = 50_000
# Built when a case runs: fifty thousand objects apiece, kept for the whole run, would cost every
# worker their build at collection and then every full garbage collection a walk over them.
SHAPES: dict[str, Callable[[], Any]] = {
    "empty objects": lambda: [{} for _ in range(N)],
    "empty lists": lambda: [[] for _ in range(N)],
    "one-key objects of a short string": lambda: [{"a": "b"} for _ in range(N)],
    "objects of distinct keys": lambda: [{f"k{i}": 0} for i in range(N)],
    "nested empty objects": lambda: [{"a": {"b": {}}} for _ in range(N)],
    "one-character strings": lambda: ["a"] * N,
    "non-ASCII one-character strings": lambda: ["é"] * N,
    "emoji strings": lambda: ["😀"] * N,
    "long ASCII strings ending in an emoji": lambda: ["a" * 10_000 + "😀" for _ in range(20)],
    "floats": lambda: [i + 0.5 for i in range(N)],
    "big integers": lambda: [10**18 + i for i in range(N)],
    "a wide object": lambda: {f"key-{i}": i for i in range(N)},
    "messages": lambda: [{"role": "user", "content": "word " * 40} for _ in range(N // 20)],
}


def _empty_free_lists() -> None:
    """A full collection empties the interpreter's free lists, so that every object the parse makes is
    a new block tracemalloc sees. What the process already holds is frozen for it, so the collection
    does not walk the whole heap (0.3 s a call in a test process); where something froze the heap
    before, a plain collection walks little anyway."""
    if gc.get_freeze_count():
        gc.collect()
        return
    gc.freeze()
    try:
        gc.collect()
    finally:
        gc.unfreeze()


def _holds(text: bytes) -> int:
    _empty_free_lists()
    tracemalloc.start()
    try:
        parsed = orjson.loads(text)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del parsed
    return held


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_estimate_bounds_what_a_parse_holds(shape: str) -> None:
    text = orjson.dumps(SHAPES[shape]())
    held = _holds(text)
    assert held <= parsed_bytes(text) <= 6 * max(held, len(text)), (held, parsed_bytes(text), len(text))


def test_escapes_that_widen_a_string_are_counted_wide() -> None:
    text = b'["' + b"a" * 100_000 + b'\\ud83d\\ude00"]'  # ASCII text, a string of 4 bytes a character
    assert _holds(text) <= parsed_bytes(text)


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value: scalars of every kind (text of any script), and lists and objects of them."""
    kind = rng.randrange(8 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randrange(-(2**63), 2**63) if rng.random() < 0.5 else rng.randrange(300)
    if kind == 3:
        return rng.uniform(-1e9, 1e9)
    if kind in (4, 5):
        alphabet = rng.choice(["ab", "abc é", "ab😀", "語", ""]) or "x"
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
    if kind == 6:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {str(rng.randrange(50)): _random_json(rng, depth + 1) for _ in range(rng.randrange(6))}


@pytest.mark.parametrize("seed", range(20))
def test_any_json_holds_no_more_than_its_estimate(seed: int) -> None:
    rng = random.Random(seed)
    text = orjson.dumps([_random_json(rng) for _ in range(2000)])
    assert _holds(text) <= parsed_bytes(text)


def test_the_account_sums_its_kinds_and_caches_give_up_in_order() -> None:
    cache = {"parses": 300, "other": 500}

    def shed(kind: str) -> Any:
        def give(wanted: int) -> int:
            freed = min(wanted, cache[kind])
            cache[kind] -= freed
            return freed

        return give

    held = HeldBytes(1000)
    held.add("tapes", lambda: 700)
    held.add("parses", lambda: cache["parses"], shed("parses"))
    held.add("other", lambda: cache["other"], shed("other"))
    assert held.by_kind() == {"tapes": 700, "parses": 300, "other": 500} and held.total() == 1500
    assert held.shed(400) == 400
    assert cache == {"parses": 0, "other": 400}  # the first added gives up first
    assert held.total() == 1100

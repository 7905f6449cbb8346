"""Grammar masks run on a bounded pool of threads, whatever comes: a flood of constrained generations
whose masks never finish (each blocks until the test releases it) starts no more than the pool's
threads, counted with `threading.enumerate()`; those waiting in line fail with a clear error once
they waited too long, those running keep their thread until they return; once released, the pool
serves the next constrained generation on the threads it has."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from tests.reliability.test_grammar_limits import DEADLINE, _HeldMask
from tokentape.core.sampling import SamplingParams
from tokentape.engines import batch_sampling
from tokentape.engines.base import Constraint
from tokentape.engines.grammar_pool import GRAMMAR_THREADS, THREAD_NAME, GrammarPool
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.errors import TokentapeError


def _grammar_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == THREAD_NAME}


def test_the_pool_never_starts_more_threads_than_its_size() -> None:
    pool = GrammarPool(3)
    before = _grammar_threads()
    release = threading.Event()
    started = threading.Semaphore(0)

    def held() -> int:
        started.release()
        release.wait()
        return 1

    futures = [pool.submit(held) for _ in range(20)]
    for _ in range(3):
        assert started.acquire(timeout=DEADLINE)
    assert len(_grammar_threads() - before) == 3 and pool.threads == 3
    assert pool.running == 3 and pool.waiting == 17
    assert not started.acquire(timeout=0.2)  # the fourth waits in line
    assert all(f.cancel() for f in futures[10:])  # taken out of the line: they never run
    release.set()
    assert [f.result(timeout=DEADLINE) for f in futures[:10]] == [1] * 10
    assert pool.peak_running == 3 and len(_grammar_threads() - before) == 3
    deadline = time.monotonic() + DEADLINE
    while pool.waiting and time.monotonic() < deadline:  # the cancelled ones leave the line
        time.sleep(0.01)
    assert pool.waiting == 0 and pool.running == 0
    assert pool.submit(lambda: 2).result(timeout=DEADLINE) == 2  # on a thread it has
    assert pool.threads == 3
    pool.close()


def test_a_task_that_raises_frees_its_thread() -> None:
    pool = GrammarPool(1)

    def fails() -> None:
        raise ValueError("no mask")

    with pytest.raises(ValueError, match="no mask"):
        pool.submit(fails).result(timeout=DEADLINE)
    assert pool.submit(lambda: 3).result(timeout=DEADLINE) == 3
    pool.close()


async def test_a_flood_of_masked_generations_never_exceeds_the_pool(
    engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_sampling, "GRAMMAR_SECONDS", 2.0)
    batcher = engine._batcher
    pool = batcher.grammars
    assert pool.size == GRAMMAR_THREADS
    before = _grammar_threads()
    real_make_mask = batcher._make_mask
    release = threading.Event()
    held: list[_HeldMask] = []

    def make_mask(native: Any, grammar: str) -> Any:
        mask = _HeldMask(real_make_mask(native, grammar), release)
        held.append(mask)
        return mask

    monkeypatch.setattr(batcher, "_make_mask", make_mask)
    constraint = Constraint("json_schema", json.dumps({"type": "string"}))
    count = GRAMMAR_THREADS + 4  # more masked generations at once than the pool has threads

    async def masked(seed: int) -> BaseException | None:
        tokens = engine.generate([1, 2, 3 + seed], SamplingParams(max_tokens=4), seed=seed, constraint=constraint)
        try:
            async for _ in tokens:
                pass
        except TokentapeError as exc:
            return exc
        finally:
            await tokens.aclose()
        return None

    flood = [asyncio.create_task(masked(seed)) for seed in range(count)]
    most = 0
    try:
        while not all(task.done() for task in flood):
            most = max(most, len(_grammar_threads() - before), pool.threads)
            await asyncio.sleep(0.01)
        outcomes = await asyncio.wait_for(asyncio.gather(*flood), DEADLINE)
        assert most <= GRAMMAR_THREADS, most
        assert len(held) == count and sum(m.applying.is_set() for m in held) <= GRAMMAR_THREADS
        codes = sorted(getattr(exc, "code", None) for exc in outcomes)
        assert set(codes) == {"grammar_too_costly", "grammar_threads_busy"}, codes
        assert codes.count("grammar_threads_busy") >= count - GRAMMAR_THREADS
    finally:
        release.set()
    # the masks that ran return now; the ones that never started are freed with their generations
    assert all([await asyncio.to_thread(m.closed.wait, DEADLINE) for m in held])
    monkeypatch.setattr(batcher, "_make_mask", real_make_mask)
    tokens = engine.generate([1, 2, 3], SamplingParams(max_tokens=3), seed=7, constraint=constraint)
    assert [token async for token in tokens]  # served on the pool's threads again
    assert len(_grammar_threads() - before) <= GRAMMAR_THREADS and pool.threads <= GRAMMAR_THREADS

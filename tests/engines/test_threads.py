"""The thread tuner: which of two thread counts the embedded engine's steps use, from how long steps
took. Driven here with step times given outright (no model, no clock): the case is the decision."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tokentape.core.sampling import SamplingParams
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings, all_threads, default_threads
from tokentape.engines.threads import ThreadTuner


def _run(tuner: ThreadTuner, seconds: dict[int, float], steps: int, rows: int = 16) -> list[int]:
    """`steps` steps of `rows` rows, each taking `seconds[threads]`; the threads each step ran with."""
    used = []
    for _ in range(steps):
        threads = tuner.threads_for(rows)
        tuner.record(threads, rows, seconds[threads])
        used.append(threads)
    return used


def test_it_starts_with_the_safe_count_and_moves_to_every_core_when_that_is_faster() -> None:
    tuner = ThreadTuner(1, 2, explore_every=48, first_explore=4)
    used = _run(tuner, {1: 0.020, 2: 0.012}, 200)
    assert used[:3] == [1, 1, 1]
    assert used[3] == 2  # the first check
    assert used[4:].count(2) >= 190 and tuner.chosen == 2  # then 2, checking 1 now and then


def test_it_goes_back_to_fewer_threads_when_the_machine_gets_busy() -> None:
    tuner = ThreadTuner(1, 2, explore_every=48, first_explore=4)
    _run(tuner, {1: 0.020, 2: 0.012}, 100)
    assert tuner.chosen == 2
    # another process takes a core: two threads now wait on each other at every barrier
    used = _run(tuner, {1: 0.020, 2: 0.110}, 100)
    assert tuner.chosen == 1
    late = used[50:]
    assert late.count(1) >= len(late) - 2  # at most a check or two with 2 threads after the switch


def test_steps_are_compared_only_with_steps_of_as_many_rows() -> None:
    """A prefill step of 512 rows is slow with any threads: it must not make a decode step look fast."""
    tuner = ThreadTuner(1, 2, explore_every=4, first_explore=1)
    assert tuner.threads_for(512) == 1  # nothing of 512 rows to compare with yet: no check
    tuner.record(1, 512, 0.5)
    assert tuner.threads_for(16) == 1
    tuner.record(1, 16, 0.02)
    for _ in range(2):
        tuner.record(tuner.threads_for(16), 16, 0.02)
    threads = tuner.threads_for(16)  # the 5th step: a check, against the latest 16-row step with 1 thread
    assert threads == 2
    tuner.record(2, 16, 0.03)  # slower than 0.02: stays with 1 (never compared with the 0.5 s prefill)
    assert tuner.chosen == 1 and tuner.log_ratio is not None and tuner.log_ratio > 0


def test_a_single_noisy_check_does_not_undo_a_settled_choice() -> None:
    tuner = ThreadTuner(1, 2, explore_every=8, first_explore=2, smoothing=0.3)
    _run(tuner, {1: 0.020, 2: 0.010}, 80)  # 2 threads twice as fast, many times over
    assert tuner.chosen == 2
    _run(tuner, {1: 0.015, 2: 0.010}, 8)  # one check in which 1 thread looked closer
    assert tuner.chosen == 2


@pytest.mark.parametrize(("low", "high"), [(2, 2), (0, 2), (3, 2)])
def test_it_needs_two_counts_to_choose_from(low: int, high: int) -> None:
    with pytest.raises(ValueError, match="smaller and a larger"):
        ThreadTuner(low, high)


async def _generate(engine: LlamaCppEngine, prompt: list[int]) -> list[tuple[int, float]]:
    params = SamplingParams(temperature=0.0, max_tokens=6)
    return [(t.token_id, t.logprob) async for t in engine.generate(prompt, params, seed=0)]


@pytest.mark.skipif(all_threads() < 2, reason="one core: nothing to choose between")
def test_the_engine_runs_its_steps_with_what_the_tuner_chose(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the engine tunes between one core free and every core; whichever it runs with, the
    context computes with that many threads, and the tokens and logprobs are those of the other."""
    engine = LlamaCppEngine(LlamaCppSettings(model_path=model_path, context_length=256, parallel=2))
    lib, native = engine._lib, engine._batcher.native
    try:
        assert engine.describe()["threads_tuned"] == [default_threads(), all_threads()]
        prompt = [1, 9690, 28, 198, 504, 2234, 314, 260]
        monkeypatch.setattr(ThreadTuner, "threads_for", lambda self, rows: self.low)
        low = asyncio.run(_generate(engine, prompt))
        assert lib.llama_n_threads(native.ctx) == default_threads() == engine.describe()["threads"]
        monkeypatch.setattr(ThreadTuner, "threads_for", lambda self, rows: self.high)
        for slot in engine._batcher.slots.slots:
            engine._batcher.native.cut(slot.seq_id, 0)
            slot.tokens = []
        high = asyncio.run(_generate(engine, prompt))
        assert lib.llama_n_threads(native.ctx) == all_threads()
        assert engine.describe()["threads"] == all_threads()
        assert [t for t, _ in high] == [t for t, _ in low]
        assert all(abs(a - b) <= 1e-3 for (_, a), (_, b) in zip(high, low, strict=True))
    finally:
        asyncio.run(engine.close())


def test_threads_given_outright_are_kept(model_path: Path) -> None:
    engine = LlamaCppEngine(LlamaCppSettings(model_path=model_path, context_length=256, threads=1))
    try:
        assert engine._batcher.tuner is None and engine.describe()["threads_tuned"] is None
    finally:
        asyncio.run(engine.close())

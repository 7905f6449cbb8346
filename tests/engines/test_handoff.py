"""The embedded engine's hand-off to the event loop: one wake-up per token for a stream, one per chunk
of tokens for a caller that reads only the whole answer, with the same tokens either way."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import SampledToken
from tokentape.engines.batching import DONE
from tokentape.engines.handoff import WHOLE_ANSWER_CHUNK, Handoff
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
from tokentape.render.renderer import Renderer, RenderOptions


def _token(i: int) -> SampledToken:
    return SampledToken(i, -0.5, ())


async def _drain(handoff: Handoff, items: list[object]) -> list[list[object]]:
    """Put `items` from another thread; the lists the loop received, up to the last item's."""

    def worker() -> None:
        for item in items:
            handoff.put(item)

    thread = threading.Thread(target=worker)
    thread.start()
    received: list[list[object]] = []
    while not received or received[-1][-1] is not items[-1]:
        received.append(await asyncio.wait_for(handoff.queue.get(), 10))
    thread.join()
    return received


async def test_a_whole_answer_comes_in_chunks_and_its_end_at_once() -> None:
    handoff = Handoff(asyncio.get_running_loop(), chunk=4)
    tokens = [_token(i) for i in range(10)]
    received = await _drain(handoff, [*tokens, DONE])
    assert received == [tokens[:4], tokens[4:8], [*tokens[8:], DONE]]
    assert handoff.wakeups == 3


async def test_an_error_is_handed_over_with_what_was_held() -> None:
    handoff = Handoff(asyncio.get_running_loop(), chunk=4)
    failure = RuntimeError("worker")
    received = await _drain(handoff, [_token(1), failure])
    assert received == [[_token(1), failure]]


async def test_a_stream_gets_every_token_at_once() -> None:
    handoff = Handoff(asyncio.get_running_loop())
    tokens = [_token(i) for i in range(5)]
    received = await _drain(handoff, [*tokens, DONE])
    assert received == [[t] for t in tokens] + [[DONE]]
    assert handoff.wakeups == 6


async def test_the_engine_wakes_the_loop_once_a_chunk_for_a_whole_answer(
    model_path: Path, renderer: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted where the worker wakes the loop (call_soon_threadsafe), on a single-slot engine whose
    seeded runs are bit-identical: the same tokens and logprobs, streamed or whole."""
    loop = asyncio.get_running_loop()
    wakeups = 0
    original = loop.call_soon_threadsafe

    def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal wakeups
        if getattr(callback, "__name__", "") == "put_nowait":
            wakeups += 1
        return original(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    engine = LlamaCppEngine(LlamaCppSettings(model_path=model_path, context_length=512, parallel=1))
    prompt = renderer.prompt([{"role": "user", "content": "Count from one to twenty."}], RenderOptions()).tokens
    # the end of turn barred: all 40 tokens are sampled, whatever this CPU's kernels make likely
    never = tuple((t, -100.0) for t in sorted(engine._end_of_turn))
    params = SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=(), logit_bias=never)
    runs = []
    try:
        for whole in (False, True):
            before = wakeups
            samples = [s async for s in engine.generate(prompt, params, seed=3, whole=whole)]
            runs.append(([(s.token_id, s.logprob) for s in samples], wakeups - before))
    finally:
        await engine.close()
    (streamed, streamed_wakeups), (whole_tokens, whole_wakeups) = runs
    assert whole_tokens == streamed
    count = len(streamed)
    assert count == 40 > 2 * WHOLE_ANSWER_CHUNK  # chunks and a rest, or the counts below say little
    assert streamed_wakeups == count + 1  # each token, then the end
    assert whole_wakeups == count // WHOLE_ANSWER_CHUNK + 1  # each full chunk, then the rest with the end

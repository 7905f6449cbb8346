"""No request, and no fault inside it, stops the embedded engine's worker for everyone else.

Driven over HTTP against the real embedded engine (its batching worker thread, llama.cpp decoding):
a temperature that once overflowed the sampler to NaN and killed the worker; then faults injected
into the worker on purpose (while sampling one generation, inside a whole step, and a worker thread
that dies outright), each followed by requests from other sessions that must be answered. Every wait
has a deadline, so a hung engine fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import MODEL_NAME
from tokentape.engines import llamacpp as llamacpp_module
from tokentape.engines.batching import Batcher
from tokentape.engines.generation import Generation
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.gateway.generation import ENGINE_ATTEMPTS

DEADLINE = 60.0  # seconds: far beyond a few tokens of the embedded model on one core


def _chat(content: str = "Say hi.", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 6, **fields}


async def _post(http: httpx.AsyncClient, session: str, body: dict[str, Any]) -> httpx.Response:
    return await asyncio.wait_for(http.post(f"/sessions/{session}/v1/chat/completions", json=body), DEADLINE)


async def _served(http: httpx.AsyncClient, session: str) -> None:
    response = await _post(http, session, _chat())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _engine_error(response: httpx.Response) -> None:
    """A failed generation's answer: OpenAI's error shape, naming the worker's failure."""
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "worker" in error["message"] or "inject" in error["message"]


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300, 9e-6])
async def test_a_vanishing_temperature_is_greedy_and_the_next_session_is_served(
    http: httpx.AsyncClient, engine: LlamaCppEngine, temperature: float
) -> None:
    faults = engine.describe()["worker_faults"]
    response = await _post(http, "s1", _chat(temperature=temperature, logprobs=True))
    assert response.status_code == 200, response.text
    logprobs = [entry["logprob"] for entry in response.json()["choices"][0]["logprobs"]["content"]]
    assert logprobs and all(np.isfinite(lp) and lp <= 0.0 for lp in logprobs)
    await _served(http, "another")
    assert engine.describe()["worker_faults"] == faults  # served greedily: nothing failed


def _failing_for(session: str, original: Callable[[Batcher, Generation, np.ndarray], None]) -> Any:
    def sample_one(self: Batcher, generation: Generation, logits: np.ndarray) -> None:
        if generation.session == session:
            raise RuntimeError("fault injected while sampling")
        original(self, generation, logits)

    return sample_one


async def test_a_fault_while_sampling_one_generation_fails_that_generation_alone(
    http: httpx.AsyncClient, engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Batcher, "_sample_one", _failing_for("victim", Batcher._sample_one))
    faults = engine.describe()["worker_faults"]
    victim, *honest = await asyncio.gather(
        _post(http, "victim", _chat(max_tokens=12)),
        *(_post(http, f"honest-{i}", _chat(f"Count to {i + 3}.", max_tokens=12)) for i in range(3)),
    )
    _engine_error(victim)
    assert all(r.status_code == 200 for r in honest), [r.text for r in honest]
    # the gateway tries a generation that failed before its first token once more: it fails again
    assert engine.describe()["worker_faults"] == faults + ENGINE_ATTEMPTS
    metrics = (await http.get("/metrics")).text
    assert f"tokentape_engine_worker_faults {float(faults + ENGINE_ATTEMPTS)}" in metrics
    await _served(http, "after")
    # the failed turn changed nothing: the victim's session has no recorded turn
    export = await http.get("/sessions/victim/export")
    assert export.status_code == 404 or not export.json()["branches"], export.text


async def test_a_fault_in_a_whole_step_fails_its_generations_and_the_worker_serves_on(
    http: httpx.AsyncClient, engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = engine._batcher.native
    original = native.decode
    calls = {"n": 0}

    def decode(rows: list[tuple[int, int, int, bool]]) -> int:
        calls["n"] += 1
        if calls["n"] == 2:  # the first step after the prompt: a generation is running
            raise MemoryError("fault injected inside a step")
        return original(rows)

    monkeypatch.setattr(native, "decode", decode)
    faults = engine.describe()["worker_faults"]
    response = await _post(http, "stepped", _chat(max_tokens=12))
    _engine_error(response)
    assert engine.describe()["worker_faults"] == faults + 1
    await _served(http, "after-step")
    await _served(http, "stepped")  # the failed session itself goes on


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_dead_worker_is_started_again_and_no_caller_waits_forever(
    http: httpx.AsyncClient, engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault that escapes even the worker's own recovery kills its thread: the waiting caller's
    check starts it again, the caller gets its error, and everyone after is served."""
    monkeypatch.setattr(llamacpp_module, "_WORKER_CHECK_SECONDS", 0.2)
    batcher = engine._batcher
    native = batcher.native
    original_decode, original_recover = native.decode, Batcher._recover
    armed = {"decode": 3, "recover": True}

    def decode(rows: list[tuple[int, int, int, bool]]) -> int:
        armed["decode"] -= 1
        if armed["decode"] == 0:  # two tokens in: the caller has had some, so it is not tried again
            raise RuntimeError("fault injected inside a step")
        return original_decode(rows)

    def recover(self: Batcher, failure: Exception) -> None:
        if armed["recover"]:
            armed["recover"] = False
            raise SystemExit("fault injected into the recovery: the thread ends")
        original_recover(self, failure)

    monkeypatch.setattr(native, "decode", decode)
    monkeypatch.setattr(Batcher, "_recover", recover)
    restarts = engine.describe()["worker_restarts"]
    response = await _post(http, "orphan", _chat(max_tokens=12, stream=True))
    assert response.status_code == 200  # the stream had begun: its error comes in the stream
    assert '"error"' in response.text and "restarted" in response.text, response.text
    assert engine.describe()["worker_restarts"] == restarts + 1
    assert batcher._thread.is_alive()
    await _served(http, "after-death")
    metrics = (await http.get("/metrics")).text
    assert f"tokentape_engine_worker_restarts {float(restarts + 1)}" in metrics


async def test_a_generation_that_cannot_start_fails_alone(
    http: httpx.AsyncClient, engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault while a generation joins the batch (out of the queue, not yet running) fails it, and
    only it: nobody else holds it, so nobody else would."""
    original = Batcher._start

    def start(self: Batcher, generation: Generation) -> None:
        if generation.session == "unstartable":
            raise RuntimeError("fault injected while joining the batch")
        original(self, generation)

    monkeypatch.setattr(Batcher, "_start", start)
    failed, served = await asyncio.gather(_post(http, "unstartable", _chat()), _post(http, "startable", _chat()))
    _engine_error(failed)
    assert served.status_code == 200, served.text

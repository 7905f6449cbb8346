"""A failing engine makes the whole update fail: every engine stays on (or goes back to) the old
weights, the version is unchanged, nothing is served in between, and the error names the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.weights import Pool, RefusingEngine
from tests.weights.reference import cold_greedy
from tests.weights.test_embedded_weights import greedy_turn
from tokentape.engines.base import SampledToken
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.engines.weights import InFlight, WeightUpdateFailed
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.render.renderer import Renderer
from tokentape.server.app import create_app
from tokentape.store.sqlite import SqliteStore


@pytest.fixture
async def pair(fresh: Gateway, own_engine: LlamaCppEngine, renderer: Renderer) -> tuple[Gateway, RefusingEngine]:
    stand_in = RefusingEngine()
    return Gateway(Pool([own_engine, stand_in]), renderer, SessionRegistry(SqliteStore(":memory:"))), stand_in


async def test_a_refused_load_leaves_every_engine_on_the_old_weights_and_serves_nothing(
    pair: tuple[Gateway, RefusingEngine], own_engine: LlamaCppEngine, model_path: Path, adapters: list[Path]
) -> None:
    gateway, stand_in = pair
    app = create_app(gateway, model_id="smollm2")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as admin:
        answer = await admin.post("/admin/weights", json={"version": 1, "lora": str(adapters[0])})
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["code"] == "weights_update_failed"
        assert "at load on engine 1 (refusing refusing): the stand-in refuses" in error["message"]
        assert "back on 0" in error["message"]  # the embedded engine had loaded it: restored
        # it failed: nothing to put back there; it is resumed and probed (a token generated)
        assert stand_in.steps == ["check", "pause", "load 1", "resume", "generate"]
        assert (own_engine.weights_version, own_engine.adapter_path) == (0, None)
        state = (await admin.get("/admin/status")).json()
        assert (state["paused"], state["weights_version"]) == (True, 0)

        # held, not served, until resumed
        turn = asyncio.create_task(greedy_turn(gateway, "held"))
        await asyncio.sleep(0.3)
        assert not turn.done() and own_engine.waiting == 0
        assert (await admin.post("/admin/resume", json={})).status_code == 200
        prompt, tokens, logprobs = await asyncio.wait_for(turn, 60)
    stop = gateway.renderer.tokenizer.end_of_turn_ids
    assert (tokens, logprobs) == cold_greedy(model_path, prompt, len(tokens), stop=stop)  # the base weights
    (node,) = (await gateway.sessions.get("held")).tree.leaves
    assert [s.version for s in node.policy_spans] == [0]


async def test_when_restoring_fails_too_resume_is_refused_until_a_rollback(
    pair: tuple[Gateway, RefusingEngine], own_engine: LlamaCppEngine, adapters: list[Path]
) -> None:
    gateway, stand_in = pair
    stand_in.loads_ok = 1  # it takes the new weights, then cannot go back; the embedded engine fails
    gateway.engine = Pool([stand_in, own_engine])
    original = own_engine.load_weights

    async def failing_load(source: object, version: int) -> None:
        raise RuntimeError("disk gone")

    own_engine.load_weights = failing_load  # type: ignore[method-assign,assignment]
    try:
        app = create_app(gateway, model_id="smollm2")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as admin:
            answer = await admin.post("/admin/weights", json={"version": 3, "lora": str(adapters[0])})
            assert answer.status_code == 502
            message = answer.json()["error"]["message"]
            assert "at load on engine 1 (llama.cpp" in message and "disk gone" in message
            assert "putting the old weights back failed too" in message and stand_in.version == 3
            resumed = await admin.post("/admin/resume", json={})
            assert resumed.status_code == 409 and resumed.json()["error"]["code"] == "weights_mixed"
            own_engine.load_weights = original  # type: ignore[method-assign]
            stand_in.loads_ok = 1
            rolled = await admin.post("/admin/rollback", json={})
            assert rolled.status_code == 200, rolled.text
            state = rolled.json()["status"]
            assert (state["paused"], state["weights_version"], stand_in.version) == (False, 0, 0)
    finally:
        own_engine.load_weights = original  # type: ignore[method-assign]


async def test_a_client_that_stops_reading_fails_the_update_without_changing_anything(
    fresh: Gateway, own_engine: LlamaCppEngine, adapters: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokentape.core.sampling import SamplingParams
    from tokentape.gateway import updates
    from tokentape.gateway.calls import ChatCall, TextDelta
    from tokentape.gateway.updates import UpdateFailed

    monkeypatch.setattr(updates, "QUIET_TIMEOUT", 0.3)
    call = ChatCall(
        messages=[{"role": "user", "content": "Count to twenty."}],
        sampling=SamplingParams(max_tokens=20, temperature=0.0),
        session_id="stuck",
    )
    events = fresh.run(call, streamed=True)
    while not isinstance(await anext(events), TextDelta):  # then it is read no further
        pass
    with pytest.raises(UpdateFailed, match=r"did not stop within 0\.3 s"):
        await fresh.update_weights(1, lora=str(adapters[0]))
    assert (fresh.gate.version, fresh.paused, own_engine.weights_version) == (0, False, 0)
    await events.aclose()


class HoldsWhilePaused(RefusingEngine):
    """Like vLLM and SGLang: a generation sent while it is paused is held until it resumes (here it
    fails at once, so that the test does not hang)."""

    def __init__(self) -> None:
        super().__init__(loads_ok=10)
        self.paused = False

    async def pause_generation(self, in_flight: InFlight) -> None:
        await super().pause_generation(in_flight)
        self.paused = True

    async def resume_generation(self, *, fresh_kv: bool) -> None:
        await super().resume_generation(fresh_kv=fresh_kv)
        self.paused = False

    async def generate(self, prompt: Any, params: Any, **options: Any) -> AsyncGenerator[SampledToken, None]:
        if self.paused:
            raise WeightUpdateFailed("a paused engine holds this request until it resumes")
        async for token in super().generate(prompt, params, **options):
            yield token


async def test_an_engine_that_holds_requests_while_paused_is_probed_after_it_resumes(
    own_engine: LlamaCppEngine, renderer: Renderer, fresh: Gateway, adapters: list[Path]
) -> None:
    stand_in = HoldsWhilePaused()
    gateway = Gateway(Pool([own_engine, stand_in]), renderer, SessionRegistry(SqliteStore(":memory:")))
    report = await gateway.update_weights(1, lora=str(adapters[0]))
    assert stand_in.steps == ["check", "pause", "load 1", "resume", "generate"]  # the probe, once resumed
    assert report["version"] == 1 and gateway.gate.version == 1 and not gateway.paused
    assert list(report["phases"]) == ["check", "hold", "pause", "load", "resume", "probe"]

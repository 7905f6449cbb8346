"""Each request has its own identity: its session's request number, recorded on its turns when it
is claimed. An SDK retry replays the turns of the latest request with its body, never those of an
earlier identical call (GRPO-style repeats send the same body on purpose), before and after a
restart. The first attempt and its retry are ordered with a gate in front of the engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tests.conftest import MODEL_NAME
from tests.support.gates import GatedEngine
from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer
from tokentape.store.sqlite import SqliteStore

BODY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Say one word."}],
    "max_tokens": 8,
    "temperature": 1.0,
}
URL = "/sessions/grpo/v1/chat/completions"
RETRY = {"x-stainless-retry-count": "1"}


def _ids(response: httpx.Response) -> list[list[int]]:
    assert response.status_code == 200, response.text
    return [choice["token_ids"] for choice in response.json()["choices"]]


async def test_a_retry_replays_only_the_latest_of_two_identical_calls(
    engine: LlamaCppEngine, renderer: Renderer, tmp_path: Path
) -> None:
    gated = GatedEngine(engine)
    store = tmp_path / "store.sqlite3"
    built = build(gated, renderer, store=SqliteStore(store))
    gateway, app = built.gateway, built.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        first = _ids(await http.post(URL, json=BODY))
        gated.gate.clear()
        gated.entered.clear()
        second_call = asyncio.create_task(http.post(URL, json=BODY))  # the same body, on purpose
        await gated.entered.wait()  # the second call is at the engine
        retry_call = asyncio.create_task(http.post(URL, json=BODY, headers=RETRY))
        while gateway.stats().retries_waiting == 0:  # the retry is waiting for the second call
            await asyncio.sleep(0.01)
        gated.gate.set()
        second, retried = _ids(await second_call), _ids(await retry_call)
        assert len(first) == len(second) == 1
        assert retried == second  # one choice: the second call's, not both calls' turns
        assert gated.calls == 2  # the retry sampled nothing
        assert (await http.get("/sessions/grpo")).json()["turns"] == 2
    gateway.sessions.close()

    # after a restart the identity comes back from the store
    restarted = build(gated, renderer, store=SqliteStore(store))
    app = restarted.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        assert _ids(await http.post(URL, json=BODY, headers=RETRY)) == second
        assert gated.calls == 2
        summary = (await http.get("/sessions/grpo")).json()
        assert (summary["turns"], summary["requests"]) == (2, 2)
    restarted.gateway.sessions.close()

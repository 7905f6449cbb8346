"""A request that fails after planning leaves nothing behind: no empty session is listed when the
engine fails before its first token or the client leaves before it. And `top_logprobs` without
`logprobs: true` is refused the way OpenAI refuses it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.support.fake_engines import serving
from tests.support.gates import GatedEngine, NoticesDisconnects
from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer

BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


async def _listed(http: httpx.AsyncClient) -> list[str]:
    return [s["session_id"] for s in (await http.get("/sessions")).json()["data"]]


async def test_an_engine_failure_before_the_first_token_leaves_no_session(
    engine: LlamaCppEngine, renderer: Renderer
) -> None:
    gated = GatedEngine(engine, fail=4)  # more failures than the gateway's one silent retry
    app = build(gated, renderer).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        failed = await http.post("/sessions/doomed/v1/chat/completions", json=BODY)
        assert failed.status_code == 502 and failed.json()["error"]["code"] == "engine_error"
        streamed = await http.post("/sessions/doomed-stream/v1/chat/completions", json={**BODY, "stream": True})
        assert streamed.status_code == 200 and '"engine_error"' in streamed.text  # an error event, then [DONE]
        assert gated.calls == 4
        assert await _listed(http) == []
        assert (await http.get("/sessions/doomed")).status_code == 404
        assert (await http.get("/sessions/doomed-stream")).status_code == 404
        ok = await http.post("/sessions/doomed/v1/chat/completions", json=BODY)  # the name is still free
        assert ok.status_code == 200 and await _listed(http) == ["doomed"]


@pytest.fixture
def gated_server(engine: LlamaCppEngine, renderer: Renderer) -> Iterator[tuple[str, GatedEngine, threading.Event]]:
    gated = GatedEngine(engine)
    app = NoticesDisconnects(build(gated, renderer).app)
    with serving(app) as url:  # type: ignore[arg-type]
        yield url, gated, app.noticed
    gated.gate.set()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_before_the_first_token_leaves_no_session(
    gated_server: tuple[str, GatedEngine, threading.Event], stream: bool
) -> None:
    url, gated, noticed = gated_server
    gated.gate.clear()  # generations wait at the engine
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        call = asyncio.create_task(http.post("/sessions/left/v1/chat/completions", json={**BODY, "stream": stream}))
        while not gated.entered.is_set():  # set on the server's loop; polled from here
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    assert await asyncio.to_thread(noticed.wait, 30), "the gateway never saw the client leave"
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        assert (await http.get("/sessions/left")).status_code == 404
        assert await _listed(http) == []


async def test_top_logprobs_without_logprobs_is_refused(http: httpx.AsyncClient) -> None:
    for body in ({**BODY, "top_logprobs": 2}, {**BODY, "logprobs": False, "top_logprobs": 2}):
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "top_logprobs"
    assert await _listed(http) == []

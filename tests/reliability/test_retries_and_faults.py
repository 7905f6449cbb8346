"""SDK retries replay instead of sampling again; disconnects abort generation; engine faults never
duplicate a turn; overload answers 429 with Retry-After; API keys guard every route but /health."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import httpx
import openai

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.errors import EngineFailure
from tokentape.gateway.service import Gateway
from tokentape.render.renderer import Renderer
from tokentape.served import Served
from tokentape.server.connections import ConnectionLimits
from tokentape.server.middleware import OPEN_PATHS

BODY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Count to five."}],
    "max_tokens": 12,
    "temperature": 1.0,
}


async def test_a_retry_replays_the_recorded_answer(http: httpx.AsyncClient, gateway: Gateway) -> None:
    first = await http.post("/sessions/r/v1/chat/completions", json=BODY)
    calls = gateway.engine_calls
    retried = await http.post("/sessions/r/v1/chat/completions", json=BODY, headers={"x-stainless-retry-count": "1"})
    assert retried.status_code == 200 and gateway.engine_calls == calls
    assert retried.json()["choices"][0]["token_ids"] == first.json()["choices"][0]["token_ids"]
    assert retried.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert retried.json()["prompt_token_ids"] == first.json()["prompt_token_ids"]
    assert (await http.get("/sessions/r")).json()["turns"] == 1
    # the same body without the retry header is a new turn
    await http.post("/sessions/r/v1/chat/completions", json=BODY)
    assert (await http.get("/sessions/r")).json()["turns"] == 2


async def test_a_concurrent_retry_waits_for_the_first_attempt(http: httpx.AsyncClient, gateway: Gateway) -> None:
    body = {**BODY, "max_tokens": 40, "stream": True}
    calls = gateway.engine_calls

    async def streamed(headers: dict[str, str]) -> list[int]:
        ids: list[int] = []
        async with http.stream("POST", "/sessions/c/v1/chat/completions", json=body, headers=headers) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                        ids += choice.get("token_ids", [])
        return ids

    first = asyncio.create_task(streamed({}))
    await asyncio.sleep(0.05)
    second = await streamed({"x-stainless-retry-count": "1"})
    assert second == await first
    assert gateway.engine_calls == calls + 1
    assert (await http.get("/sessions/c")).json()["turns"] == 1


async def test_the_sdk_retrying_after_a_lost_response_makes_one_turn(built: Served) -> None:
    """A real openai SDK retry: the first response is lost on the way back; the SDK retries with
    x-stainless-retry-count: 1 and gets the recorded answer."""
    gateway, app = built.gateway, built.app
    inner = httpx.ASGITransport(app=app)

    class LosingTransport(httpx.AsyncBaseTransport):
        lost = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await inner.handle_async_request(request)
            if request.url.path.endswith("/chat/completions") and not self.lost:
                self.lost += 1
                await response.aread()
                raise httpx.ReadTimeout("the response was lost", request=request)
            return response

    async with httpx.AsyncClient(transport=LosingTransport(), base_url="http://t") as client:
        sdk = openai.AsyncOpenAI(base_url="http://t/sessions/lost/v1", api_key="x", http_client=client, max_retries=2)
        reply = await sdk.chat.completions.create(**BODY)
        assert reply.choices[0].message.content
    summary = (await gateway.sessions.get("lost")).summary()
    assert summary["turns"] == 1 and summary["requests"] == 1


class FlakyEngine:
    """Fails the first generation before any token; later ones fail after two tokens."""

    def __init__(self, vocab_token: int) -> None:
        self.model_id, self.context_length, self.calls, self.token = "flaky", 4096, 0, vocab_token

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
    ) -> AsyncGenerator[SampledToken, None]:
        self.calls += 1
        if self.calls == 1:
            raise EngineFailure("engine restarting")
        if self.calls == 2:
            for _ in range(3):
                yield SampledToken(self.token, -0.1)
            yield SampledToken(2, -0.1)
            return
        yield SampledToken(self.token, -0.1)
        yield SampledToken(self.token, -0.1)
        raise EngineFailure("engine crashed mid-generation")

    def describe(self) -> dict[str, Any]:
        return {"kind": "flaky", "calls": self.calls, "tokens_generated": None}

    async def close(self) -> None:
        return None


async def test_engine_faults_retry_before_the_first_token_and_never_duplicate(renderer: Renderer) -> None:
    engine = FlakyEngine(renderer.tokenizer.encode("ok")[0])
    app = build(engine, renderer).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        ok = await http.post("/sessions/f/v1/chat/completions", json=BODY)
        assert ok.status_code == 200 and engine.calls == 2  # failed before a token: retried once
        lines = []
        async with http.stream("POST", "/sessions/g/v1/chat/completions", json={**BODY, "stream": True}) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert '"error"' in lines[-2] and "crashed" in lines[-2]
        assert engine.calls == 3  # tokens were sent: no second generation
        # what a failed engine sent before it failed is not trusted: no turn is recorded from it
        export = await http.get("/sessions/g/export")
        assert export.status_code == 404 or export.json()["branches"] == []
        assert (await http.get("/health")).status_code == 200


async def test_overload_answers_429_with_retry_after(engine: LlamaCppEngine, renderer: Renderer) -> None:
    built = build(engine, renderer, max_active=1)
    gateway, app = built.gateway, built.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        responses = await asyncio.gather(
            *(http.post(f"/sessions/o{i}/v1/chat/completions", json={**BODY, "max_tokens": 20}) for i in range(4))
        )
    statuses = sorted(r.status_code for r in responses)
    assert statuses[0] == 200 and 429 in statuses
    for rejected in (r for r in responses if r.status_code == 429):
        assert rejected.headers["retry-after"] == "1" and rejected.headers["retry-after-ms"] == "1000"
        assert rejected.json()["error"]["type"] == "rate_limit_error"
    assert gateway.stats().requests_active == 0


def _route_paths(app: Any) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or []):
            if method != "HEAD":
                out.append((method, route.path.replace("{session_id}", "x")))
    return out


async def test_api_keys_guard_every_route_but_health(engine: LlamaCppEngine, renderer: Renderer) -> None:
    app = build(engine, renderer, api_keys=("k1", "k2")).app
    routes = _route_paths(app)
    assert len(routes) > 12
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        for method, path in routes:
            response = await http.request(method, path)
            if path in OPEN_PATHS:
                assert response.status_code == 200
            else:
                assert response.status_code == 401, (method, path)
                assert response.json()["error"]["type"] == "authentication_error"
        for headers in ({"authorization": "Bearer k2"}, {"x-api-key": "k1"}):
            assert (await http.get("/v1/models", headers=headers)).status_code == 200
        for wrong in ({"authorization": "Bearer k3"}, {"authorization": "k1"}, {"x-api-key": ""}):
            assert (await http.get("/v1/models", headers=wrong)).status_code == 401
        sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k1", http_client=http, max_retries=0)
        assert (await sdk.models.list()).data[0].id == MODEL_NAME


async def test_size_limits(engine: LlamaCppEngine, renderer: Renderer) -> None:
    limits = ConnectionLimits(max_header_bytes=4_000)
    built = build(engine, renderer, max_body_bytes=10_000, connections=limits)
    gateway, app = built.gateway, built.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 20_000}]}
        response = await http.post("/v1/chat/completions", json=big)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        response = await http.get("/v1/models", headers={"x-padding": "y" * 5_000})
        assert response.status_code == 431
    assert len(gateway.sessions) == 0

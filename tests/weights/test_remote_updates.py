"""`POST /admin/weights` through a gateway routing to two remote engines (vLLM and SGLang stand-ins
speaking their weight routes): both are checked, paused, loaded, probed and resumed in that order
before the version changes; a load one of them refuses changes the version on neither and names it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.engines.test_remote_weights import Stand
from tests.support.fake_engines import serving
from tests.support.served import build
from tokentape.engines.remote import SGLangEngine, VLLMEngine
from tokentape.engines.router import Router
from tokentape.gateway.service import Gateway
from tokentape.render.renderer import Renderer

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.fixture
async def pool(renderer: Renderer) -> AsyncIterator[tuple[httpx.AsyncClient, Stand, Stand, Gateway]]:
    vllm, sglang = Stand("vllm"), Stand("sglang", version="0.5.9")
    with serving(vllm.app()) as vllm_url, serving(sglang.app()) as sglang_url:
        router = Router([VLLMEngine(vllm_url), SGLangEngine(sglang_url)], vocab_size=49152)
        built = build(router, renderer, model="fake-model")
        gateway, app = built.gateway, built.app
        await gateway.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            yield http, vllm, sglang, gateway
        await gateway.aclose()


def _posts(stand: Stand) -> list[str]:
    return [path for method, path, _ in stand.calls if method == "POST" and not path.startswith("/v1/chat")]


async def test_every_remote_engine_takes_the_adapter_before_the_version_changes(
    pool: tuple[httpx.AsyncClient, Stand, Stand, Gateway],
) -> None:
    http, vllm, sglang, gateway = pool
    answer = await http.post("/admin/weights", json={"version": 7, "lora": "/adapters/step-7"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["version"] == 7 and answer.json()["status"]["paused"] is False
    assert [p for p in _posts(vllm) if not p.startswith("/v1/completions")][:4] == [
        "/pause?mode=abort",
        "/v1/load_lora_adapter",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert [p for p in _posts(sglang) if p != "/generate"] == [
        "/pause_generation",
        "/load_lora_adapter",
        "/flush_cache",
        "/continue_generation",
    ]
    assert (await http.post("/sessions/s/v1/chat/completions", json=BODY)).status_code == 200
    (turn,) = (await gateway.sessions.get("s")).tree.leaves
    assert [s.version for s in turn.policy_spans] == [7]


async def test_a_refused_load_changes_the_version_on_no_engine(
    pool: tuple[httpx.AsyncClient, Stand, Stand, Gateway],
) -> None:
    http, vllm, sglang, gateway = pool
    sglang.refuse["/load_lora_adapter"] = (400, {"success": False, "error_message": "rank 64 exceeds max_lora_rank"})
    answer = await http.post("/admin/weights", json={"version": 7, "lora": "/adapters/step-7"})
    assert answer.status_code == 502
    message = answer.json()["error"]["message"]
    assert f"at load on engine 1 ({sglang_url(gateway)})" in message and "max_lora_rank" in message
    state = (await http.get("/admin/status")).json()
    assert (state["weights_version"], state["paused"]) == (0, True)  # held until resume or rollback
    # both engines run again (a paused vLLM would hold every later request); the gateway's gate holds
    assert _posts(vllm)[-1:] == ["/resume"] and not vllm.paused
    assert not sglang.paused and "/continue_generation" in _posts(sglang)
    # vLLM took the adapter and cannot be put back on the weights it started with: mixed
    assert "putting the old weights back failed too" in message
    resumed = await http.post("/admin/resume", json={})
    assert resumed.status_code == 409 and resumed.json()["error"]["code"] == "weights_mixed"
    # a new update is the way out: every engine takes the same weights, then generation resumes
    del sglang.refuse["/load_lora_adapter"]
    again = await http.post("/admin/weights", json={"version": 8, "lora": "/adapters/step-8"})
    assert again.status_code == 200, again.text
    assert (again.json()["status"]["weights_version"], again.json()["status"]["paused"]) == (8, False)


def sglang_url(gateway: Gateway) -> str:
    return str(gateway.engines()[1].base_url)  # type: ignore[attr-defined]


async def test_a_failed_update_leaves_the_remote_engines_resumed_and_serving(
    pool: tuple[httpx.AsyncClient, Stand, Stand, Gateway],
) -> None:
    """Both engines refuse the load (nothing loaded, nothing to put back): both are resumed and probed
    before the 502, and after /admin/resume requests are served on both (the stand-ins hold every
    generation while paused, as vLLM and SGLang do: left paused, the requests below would hang)."""
    http, vllm, sglang, _ = pool
    vllm.refuse["/v1/load_lora_adapter"] = (500, {"error": "the stand-in refuses"})
    sglang.refuse["/load_lora_adapter"] = (400, {"success": False, "error_message": "the stand-in refuses"})
    answer = await http.post("/admin/weights", json={"version": 7, "lora": "/adapters/step-7"})
    assert answer.status_code == 502 and "the stand-in refuses" in answer.json()["error"]["message"]
    assert not vllm.paused and not sglang.paused
    posts = _posts(vllm)
    assert posts.index("/pause?mode=abort") < posts.index("/v1/load_lora_adapter") < posts.index("/resume")
    assert "/reset_prefix_cache" not in posts  # nothing ran under new weights: the cache stays
    assert (await http.post("/admin/resume", json={})).status_code == 200
    before = len(vllm.generation.requests), len(sglang.generation.requests)  # the probes, once resumed
    for session in ("a", "b"):
        served = await asyncio.wait_for(http.post(f"/sessions/{session}/v1/chat/completions", json=BODY), 10)
        assert served.status_code == 200, served.text
    assert len(vllm.generation.requests) + len(sglang.generation.requests) - sum(before) == 2
    assert (await http.get("/admin/status")).json()["weights_version"] == 0

"""An engine added to the pool would start on the weights it was launched with, while the gateway
records what it samples under the current version: once the weights changed (or while they change)
the pool takes no new engine, and nothing is served by one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.engines.test_remote_weights import Stand
from tests.support.fake_engines import serving
from tests.support.served import build
from tokentape.engines.remote import VLLMEngine
from tokentape.engines.router import Router
from tokentape.gateway.service import Gateway
from tokentape.render.renderer import Renderer

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.fixture
async def pool(renderer: Renderer) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway, Stand, str]]:
    first, late = Stand("vllm"), Stand("vllm")
    with serving(first.app()) as first_url, serving(late.app()) as late_url:
        built = build(Router([VLLMEngine(first_url)], vocab_size=49152), renderer, model="fake-model")
        gateway, app = built.gateway, built.app
        await gateway.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            yield http, gateway, late, late_url
        await gateway.aclose()


def _served(stand: Stand) -> list[str]:
    return [path for method, path, _ in stand.calls if method == "POST" and path.startswith("/v1/")]


async def test_an_engine_is_added_while_the_weights_are_the_starting_ones(
    pool: tuple[httpx.AsyncClient, Gateway, Stand, str],
) -> None:
    http, gateway, _, late_url = pool
    added = await http.post("/admin/engines", json={"add": f"vllm={late_url}"})
    assert added.status_code == 200, added.text
    assert len(gateway.engines()) == 2


async def test_no_engine_joins_once_the_weights_changed(pool: tuple[httpx.AsyncClient, Gateway, Stand, str]) -> None:
    http, gateway, late, late_url = pool
    assert (await http.post("/admin/weights", json={"version": 3, "lora": "/adapters/step-3"})).status_code == 200
    added = await http.post("/admin/engines", json={"add": f"vllm={late_url}"})
    assert added.status_code == 409, added.text
    assert added.json()["error"]["code"] == "weights_changed"
    assert "version 3" in added.json()["error"]["message"]
    assert len(gateway.engines()) == 1
    for n in range(4):  # every turn is sampled by the engine that holds version 3
        assert (await http.post(f"/sessions/s{n}/v1/chat/completions", json=BODY)).status_code == 200
    assert _served(late) == []


async def test_no_engine_joins_while_an_update_runs(pool: tuple[httpx.AsyncClient, Gateway, Stand, str]) -> None:
    http, gateway, _, late_url = pool
    gateway.updates.running = True  # what an update in progress sets until it is done
    added = await http.post("/admin/engines", json={"add": f"vllm={late_url}"})
    assert added.status_code == 409 and added.json()["error"]["code"] == "weights_changed"
    assert len(gateway.engines()) == 1


async def test_no_engine_joins_once_a_trainer_set_the_version_by_hand(
    pool: tuple[httpx.AsyncClient, Gateway, Stand, str],
) -> None:
    http, gateway, _, late_url = pool
    assert (await http.post("/admin/pause", json={})).status_code == 200
    # weights pushed by the trainer itself (e.g. over NCCL), then the version named on resume
    assert (await http.post("/admin/resume", json={"policy_version": 4})).status_code == 200
    added = await http.post("/admin/engines", json={"add": f"vllm={late_url}"})
    assert added.status_code == 409 and added.json()["error"]["code"] == "weights_changed"
    assert len(gateway.engines()) == 1

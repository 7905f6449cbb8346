"""tokentape on Ray in front of a real vLLM: two gateway actors share one vLLM engine through the
engine registry; each session runs the five-turn exactness scenario against its owner's base URL,
and every call equals its session's export."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.ray.conftest import free_port_block, loopback_only
from tests.support.scenarios import five_turn_scenario
from tests.vllm.conftest import MODEL, VLLM_PYTHON, VLLMServer

pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON, reason="a real vLLM runs under `make e2e-vllm` only"),
    pytest.mark.skipif(not loopback_only(), reason="Ray runs on loopback only: make e2e-vllm runs this in a namespace"),
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def cluster(vllm_server: VLLMServer, vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import ray

    from tokentape.ray import RayOptions, ServeSpec, connect, start_cluster

    connect("local", num_cpus=2)
    started = start_cluster(
        ServeSpec(
            engines=(f"vllm={vllm_server.url},logprobs-mode=processed_logprobs",),
            tokenizer=vllm_model_dir,
            served_model_name=MODEL,
            port=free_port_block(3),  # gateway i serves on port + 1 + i
            ray=RayOptions(gateways=2, store_dir=str(tmp_path_factory.mktemp("shards"))),
        )
    )
    try:
        yield started
    finally:
        started.stop()
        ray.shutdown()


async def _episode(base_url: str, session: str) -> None:
    owner = base_url.split("/sessions/")[0]
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    async with httpx.AsyncClient(base_url=owner, timeout=600) as http:
        await five_turn_scenario(client, MODEL, http, session)


def test_sessions_on_two_gateway_actors_are_exact_against_real_vllm(cluster: Any) -> None:
    urls = cluster.gateway_urls
    created = [httpx.post(f"{urls[0]}/sessions", json={"session_id": f"ray-vllm-{i}"}).json() for i in range(2)]
    assert {c["base_url"].split("/sessions/")[0] for c in created} == set(urls.values())

    async def run() -> None:
        await asyncio.gather(*(_episode(c["base_url"], c["session_id"]) for c in created))

    asyncio.run(run())
    import ray

    engines = ray.get(cluster.registry.describe.remote())
    assert sum(engines["sessions"].values()) == 2 and engines["moves"] == 0

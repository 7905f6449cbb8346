"""A weight update across a cluster: the engine registry loads the adapter on the engine actor and
switches every gateway to the new version together; a turn on any gateway is then sampled (and
recorded) under it; status shows the version per engine; a bad update changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from tests.ray.conftest import free_port_block
from tests.support.lora import write_lora

MODEL = "smollm2-135m-instruct"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def weights_cluster(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tokentape.ray import ClusterSettings, start_cluster
    from tokentape.runtime import RuntimeSettings

    first = free_port_block(3)
    started = start_cluster(
        ClusterSettings(
            gateways=2,
            first_port=first + 1,
            store_dir=str(tmp_path_factory.mktemp("weight-shards")),
            runtime=RuntimeSettings(context_length=1024, threads=1),
            engine_actors=1,
        )
    )
    try:
        yield started
    finally:
        started.stop()


def test_every_gateway_switches_version_together(weights_cluster: Any, tmp_path: Path) -> None:
    from tokentape.ray.cluster import cluster_status

    adapter = write_lora(tmp_path / "adapter.gguf", seed=5)
    urls = list(weights_cluster.gateway_urls.values())
    before = [
        httpx.post(f"{u}/sessions/before-{i}/v1/chat/completions", json=BODY, timeout=60) for i, u in enumerate(urls)
    ]
    assert all(r.status_code == 200 for r in before)

    # through one gateway's admin route: the registry runs it over the whole cluster
    answer = httpx.post(f"{urls[0]}/admin/weights", json={"version": 1, "lora": str(adapter)}, timeout=120)
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["engines"] == {"tokentape-engine-0": 1} and len(report["gateways"]) == 2
    assert set(report["phases"]) == {"check", "hold", "pause", "load", "probe", "resume"}
    states = [httpx.get(f"{u}/admin/status", timeout=30).json() for u in urls]
    assert [(s["weights_version"], s["paused"]) for s in states] == [(1, False), (1, False)]
    status = cluster_status()
    assert status["engines"]["engine_versions"] == {"tokentape-engine-0": 1}
    assert [g["weights_version"] for g in status["gateways"]] == [1, 1]

    for i, url in enumerate(urls):
        after = httpx.post(f"{url}/sessions/after-{i}/v1/chat/completions", json=BODY, timeout=60)
        assert after.status_code == 200
        branch = httpx.get(f"{url}/sessions/after-{i}/export", timeout=30).json()["branches"][0]
        (start, end) = branch["action_ranges"][0]
        assert branch["policy_spans"] == [[{"version": 1, "start": 0, "end": end - start}]]
        assert branch["param_version_start"] == branch["param_version_end"] == 1

    # the same through the Python API; then a stale version and a missing path change nothing
    assert weights_cluster.update_weights(2, lora=str(adapter))["version"] == 2
    refused = httpx.post(f"{urls[1]}/admin/weights", json={"version": 2, "lora": str(adapter)}, timeout=60)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "version_not_new"
    missing = httpx.post(f"{urls[1]}/admin/weights", json={"version": 3, "lora": "/nope.gguf"}, timeout=60)
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    assert [httpx.get(f"{u}/admin/status", timeout=30).json()["weights_version"] for u in urls] == [2, 2]
    assert ray.get(weights_cluster.engines[0].info.remote())["weights_version"] == 2

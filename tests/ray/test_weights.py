"""A weight update across a cluster: the engine registry loads the adapter on the engine actor and
switches every gateway to the new version together; a turn on any gateway is then sampled (and
recorded) under it; status shows the version per engine; a bad update changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from tests.ray.conftest import free_port_block
from tests.support.http_client import fresh_connections
from tests.support.lora import write_lora
from tokentape.core.staleness import Staleness, admission_limit

HTTP = fresh_connections()  # one TLS context for the module's calls, a connection for each

MODEL = "smollm2-135m-instruct"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def weights_cluster(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tokentape.ray import RayOptions, ServeSpec, start_cluster

    first = free_port_block(3)
    started = start_cluster(
        ServeSpec(
            context_length=1024,
            threads=1,
            port=first,  # gateway i serves on first + 1 + i
            # as `serve --ray --max-staleness 1 --admit-per-version 2` passes them to every gateway
            staleness=Staleness(max_staleness=1, admit_per_version=2),
            ray=RayOptions(gateways=2, store_dir=str(tmp_path_factory.mktemp("weight-shards")), engine_actors=1),
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
        HTTP.post(f"{u}/sessions/before-{i}/v1/chat/completions", json=BODY, timeout=60) for i, u in enumerate(urls)
    ]
    assert all(r.status_code == 200 for r in before)

    # through one gateway's admin route: the registry runs it over the whole cluster
    answer = HTTP.post(f"{urls[0]}/admin/weights", json={"version": 1, "lora": str(adapter)}, timeout=120)
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["engines"] == {"tokentape-engine-0": 1} and len(report["gateways"]) == 2
    assert set(report["phases"]) == {"check", "hold", "pause", "load", "probe", "resume"}
    states = [HTTP.get(f"{u}/admin/status", timeout=30).json() for u in urls]
    assert [(s["weights_version"], s["paused"]) for s in states] == [(1, False), (1, False)]
    status = cluster_status()
    assert status["engines"]["engine_versions"] == {"tokentape-engine-0": 1}
    assert [g["weights_version"] for g in status["gateways"]] == [1, 1]

    for i, url in enumerate(urls):
        after = HTTP.post(f"{url}/sessions/after-{i}/v1/chat/completions", json=BODY, timeout=60)
        assert after.status_code == 200
        branch = HTTP.get(f"{url}/sessions/after-{i}/export", timeout=30).json()["branches"][0]
        (start, end) = branch["action_ranges"][0]
        assert branch["policy_spans"] == [[{"version": 1, "start": 0, "end": end - start}]]
        assert branch["param_version_start"] == branch["param_version_end"] == 1

    # the same through the Python API; then a stale version and a missing path change nothing
    assert weights_cluster.update_weights(2, lora=str(adapter))["version"] == 2
    refused = HTTP.post(f"{urls[1]}/admin/weights", json={"version": 2, "lora": str(adapter)}, timeout=60)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "version_not_new"
    missing = HTTP.post(f"{urls[1]}/admin/weights", json={"version": 3, "lora": "/nope.gguf"}, timeout=60)
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    assert [HTTP.get(f"{u}/admin/status", timeout=30).json()["weights_version"] for u in urls] == [2, 2]
    assert ray.get(weights_cluster.engines[0].info.remote())["weights_version"] == 2


def test_a_restarted_gateway_starts_at_the_clusters_version(weights_cluster: Any, tmp_path: Path) -> None:
    """A gateway restarted after an update (kill -9: Ray starts it again) serves on engine actors that
    hold the update's weights: it starts at the cluster's version, so what it records says so."""
    import os
    import signal
    import time

    assert weights_cluster.update_weights(3, lora=str(write_lora(tmp_path / "adapter.gguf", seed=7)))["version"] == 3
    victim = weights_cluster.describe()[1]
    assert victim["weights_version"] == 3
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while weights_cluster.describe()[1]["pid"] == victim["pid"] and time.monotonic() < deadline:
        time.sleep(0.2)
    restarted = weights_cluster.describe()[1]
    assert restarted["pid"] != victim["pid"]
    assert restarted["weights_version"] == 3  # the engine actor holds version 3's weights
    url = restarted["url"]
    assert HTTP.post(f"{url}/sessions/after-restart/v1/chat/completions", json=BODY, timeout=60).status_code == 200
    branch = HTTP.get(f"{url}/sessions/after-restart/export", timeout=30).json()["branches"][0]
    assert branch["param_version_start"] == branch["param_version_end"] == 3
    assert branch["policy_versions"] == ["3"]


def test_status_shows_the_version_of_each_gateway_and_engine(weights_cluster: Any) -> None:
    from typer.testing import CliRunner

    from tokentape.cli import app

    shown = CliRunner().invoke(app, ["status"], env={"COLUMNS": "240"})
    assert shown.exit_code == 0, shown.output
    assert "weights version" in shown.output
    for gateway in weights_cluster.describe():
        (row,) = [line for line in shown.output.splitlines() if gateway["url"] in line]
        assert row.rstrip(" │|").split()[-1] == "3"
    (engine_row,) = [line for line in shown.output.splitlines() if "tokentape-engine-0" in line]
    assert engine_row.rstrip(" │|").split()[-1] == "3"


def test_a_gateway_held_by_a_cluster_update_is_not_resumed_by_hand(weights_cluster: Any) -> None:
    """While the registry holds the gateways (an update loading, or one that failed), `/admin/resume`
    on one gateway would serve on engine actors whose weights are changing: refused until released."""
    from tokentape.ray.actors import NAMESPACE, gateway_name

    url = weights_cluster.describe()[0]["url"]
    gateway = ray.get_actor(gateway_name(0), namespace=NAMESPACE)
    ray.get(gateway.hold_for_update.remote("continue"))  # what the registry does first
    try:
        resumed = HTTP.post(f"{url}/admin/resume", json={}, timeout=30)
        assert resumed.status_code == 409, resumed.text
        assert resumed.json()["error"]["code"] == "update_in_progress"
        assert HTTP.get(f"{url}/admin/status", timeout=30).json()["paused"] is True
    finally:
        ray.get(gateway.finish_update.remote(None))  # what the registry does after a rollback
    assert HTTP.get(f"{url}/admin/status", timeout=30).json()["paused"] is False
    assert HTTP.post(f"{url}/admin/resume", json={}, timeout=30).status_code == 200


def test_staleness_options_reach_every_gateway(weights_cluster: Any, tmp_path: Path) -> None:
    adapter = write_lora(tmp_path / "adapter.gguf", seed=6)
    urls = list(weights_cluster.gateway_urls.values())
    version = HTTP.get(f"{urls[0]}/admin/status", timeout=30).json()["weights_version"]
    # admission: each gateway admits at most (K + version + 1) x B groups; 2 x that + 4 new ones cannot all fit
    tries = 2 * admission_limit(version, 1, 2) + 4
    answers = [
        HTTP.post(f"{urls[i % 2]}/sessions/adm-{i}/v1/chat/completions", json=BODY, timeout=60) for i in range(tries)
    ]
    admitted = [i for i, r in enumerate(answers) if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert refused and all(r.status_code == 429 for r in refused)
    assert {r.json()["error"]["code"] for r in refused} == {"admission_closed"}
    assert all(r.headers["retry-after"] for r in refused)
    assert len(admitted) <= 2 * admission_limit(version, 1, 2)
    # max_staleness 1: a session begun at `version` goes on one version later, not two; one whose own K
    # is 0 (set at creation through the cluster) only at the version it began under
    old = f"adm-{admitted[0]}"
    assert weights_cluster.update_weights(version + 1, lora=str(adapter))["version"] == version + 1
    assert HTTP.post(f"{urls[1]}/sessions/{old}/v1/chat/completions", json=BODY, timeout=60).status_code == 200
    own = HTTP.post(f"{urls[1]}/sessions", json={"session_id": "own-k0", "max_staleness": 0}, timeout=30)
    assert own.status_code == 201 and own.json()["max_staleness"] == 0
    assert HTTP.post(f"{urls[0]}/sessions/own-k0/v1/chat/completions", json=BODY, timeout=60).status_code == 200
    assert weights_cluster.update_weights(version + 2, lora=str(adapter))["version"] == version + 2
    for name in (old, "own-k0"):
        stale = HTTP.post(f"{urls[0]}/sessions/{name}/v1/chat/completions", json=BODY, timeout=60)
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "session_stale", name

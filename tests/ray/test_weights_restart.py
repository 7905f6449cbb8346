"""A gateway restarted after a weight update (kill -9: Ray starts it again) serves on engine actors
that hold the update's weights: it starts at the cluster's version, so what it records says so."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ray.conftest import free_port_block
from tests.support.lora import write_lora

MODEL = "smollm2-135m-instruct"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tokentape.ray import ClusterSettings, start_cluster
    from tokentape.runtime import RuntimeSettings

    first = free_port_block(2)
    started = start_cluster(
        ClusterSettings(
            gateways=1,
            first_port=first + 1,
            store_dir=str(tmp_path_factory.mktemp("restart-shards")),
            runtime=RuntimeSettings(context_length=1024, threads=1),
            engine_actors=1,
        )
    )
    try:
        yield started
    finally:
        started.stop()


def test_a_restarted_gateway_starts_at_the_clusters_version(cluster: Any, tmp_path: Path) -> None:
    assert cluster.update_weights(3, lora=str(write_lora(tmp_path / "adapter.gguf", seed=7)))["version"] == 3
    (victim,) = cluster.describe()
    assert victim["weights_version"] == 3
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while cluster.describe()[0]["pid"] == victim["pid"] and time.monotonic() < deadline:
        time.sleep(0.2)
    (restarted,) = cluster.describe()
    assert restarted["pid"] != victim["pid"]
    assert restarted["weights_version"] == 3  # the engine actor holds version 3's weights
    url = restarted["url"]
    assert httpx.post(f"{url}/sessions/after-restart/v1/chat/completions", json=BODY, timeout=60).status_code == 200
    branch = httpx.get(f"{url}/sessions/after-restart/export", timeout=30).json()["branches"][0]
    assert branch["param_version_start"] == branch["param_version_end"] == 3
    assert branch["policy_versions"] == ["3"]


def test_status_shows_the_version_of_each_gateway_and_engine(cluster: Any) -> None:
    from typer.testing import CliRunner

    from tokentape.cli import app

    shown = CliRunner().invoke(app, ["status"], env={"COLUMNS": "240"})
    assert shown.exit_code == 0, shown.output
    (gateway_row,) = [line for line in shown.output.splitlines() if cluster.describe()[0]["url"] in line]
    assert "weights version" in shown.output and gateway_row.rstrip(" │|").split()[-1] == "3"
    (engine_row,) = [line for line in shown.output.splitlines() if "tokentape-engine-0" in line]
    assert engine_row.rstrip(" │|").split()[-1] == "3"

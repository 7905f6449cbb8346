"""A process that exists to serve the gateway settles its garbage collector once the gateway has
started: what it loaded is frozen and collections come less often. A gateway built into another
program leaves that program's collector as it was."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.testclient import TestClient
from typer.testing import CliRunner

from tokentape.cli import app as cli
from tokentape.served import Served


@pytest.fixture
def restored_collector() -> Iterator[tuple[int, int, int]]:
    """The collector's thresholds as they were; put back (and nothing left frozen) afterwards."""
    threshold = gc.get_threshold()
    yield threshold
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_serve_freezes_what_it_loaded_once_the_gateway_has_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, restored_collector: tuple[int, int, int]
) -> None:
    seen: dict[str, Any] = {}

    def run(app: Any, **_: Any) -> None:
        seen["before start"] = gc.get_freeze_count()
        with TestClient(app) as client:  # runs the app's start-up: the gateway starts, then serves
            seen["frozen"] = gc.get_freeze_count()
            seen["threshold"] = gc.get_threshold()
            seen["health"] = client.get("/health").status_code

    monkeypatch.setattr(uvicorn, "run", run)
    gc.collect()  # what earlier tests left unreachable is not alive: settling collects it before freezing
    alive = len(gc.get_objects())
    result = CliRunner().invoke(cli, ["serve", "--store", str(tmp_path / "t.sqlite3"), "--log-level", "warning"])
    assert result.exit_code == 0, result.output
    assert seen["health"] == 200
    assert seen["before start"] == 0  # settled after the gateway started: what it loads then is frozen too
    assert seen["frozen"] >= 0.9 * alive  # everything this process held before `serve` ran, and more
    young, middle, old = seen["threshold"]
    assert young >= 10 * restored_collector[0] and middle >= restored_collector[1] and old >= restored_collector[2]


def test_a_gateway_inside_another_program_leaves_its_collector_alone(
    built: Served, restored_collector: tuple[int, int, int]
) -> None:
    with TestClient(built.app) as client:
        assert client.get("/health").status_code == 200
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == restored_collector

"""`tokentape export` streams a gateway's dataset to a file: the same rows `GET /export` answers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tests.conftest import MODEL_NAME
from tests.store.test_export_late_fields import _plain
from tests.support.fake_engines import serving
from tests.support.served import build
from tokentape.cli import app as cli
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.store import export as store_export
from tokentape.store.datasets import read_dataset
from tokentape.store.sqlite import SqliteStore


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_writes_the_gateways_rows(
    suffix: str, tmp_path: Path, engine: LlamaCppEngine, renderer: Renderer
) -> None:
    store = SqliteStore(tmp_path / "store.sqlite3")
    with serving(build(engine, renderer, store=store).app) as url:  # type: ignore[arg-type]
        for session in ("e1", "e2", "e3"):
            httpx.post(f"{url}/sessions", json={"session_id": session, "group_id": "g"}).raise_for_status()
            body: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": session}]}
            response = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json={**body, "max_tokens": 3})
            response.raise_for_status()
        expected = httpx.get(f"{url}/export", params={"format": "verifiers"}).json()["data"]
        out = tmp_path / "data" / f"batch{suffix}"
        result = CliRunner().invoke(cli, ["export", str(out), "--url", url, "--format", "verifiers"])
    assert result.exit_code == 0, result.output
    assert f"{out}: 3 verifiers rows" in result.output
    assert read_dataset(out) == expected and len(expected) == 3
    assert not out.with_name(out.name + ".partial").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_export_that_fails_after_its_first_byte_leaves_no_dataset(
    suffix: str, tmp_path: Path, renderer: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway ends the body with its error: the command says so, fails, and keeps no file."""
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)

    async def write() -> None:
        for index in range(70):  # two pages of sessions
            tree = _plain(index)
            for node in tree.nodes:
                assert await store.save_turn(tree, node)

    asyncio.run(write())
    store.close()
    real_rows, calls = store_export.format_rows, [0]

    def failing_rows(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("a row the export cannot write")
        return real_rows(*args, **kwargs)

    monkeypatch.setattr(store_export, "format_rows", failing_rows)
    engine = ScriptedEngine([5], end_of_turn=2)
    with serving(build(engine, renderer, store=SqliteStore(path)).app) as url:  # type: ignore[arg-type]
        out = tmp_path / f"batch{suffix}"
        result = CliRunner().invoke(cli, ["export", str(out), "--url", url])
    assert result.exit_code == 1 and "a row the export cannot write" in result.output, result.output
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_export_refuses_an_unknown_file_kind(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "batch.csv"), "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 1 and "a dataset file ends in .jsonl or .parquet" in result.output
    assert not (tmp_path / "batch.csv").exists()


def test_export_and_view_reach_a_gateway_with_trainer_keys(
    tmp_path: Path, engine: LlamaCppEngine, renderer: Renderer
) -> None:
    trainer = {"authorization": "Bearer cli-trainer-key"}
    app = build(engine, renderer, api_keys=("cli-trainer-key",)).app
    with serving(app) as url:  # type: ignore[arg-type]
        httpx.post(f"{url}/sessions", json={"session_id": "k1"}, headers=trainer).raise_for_status()
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "k1"}], "max_tokens": 2}
        httpx.post(f"{url}/sessions/k1/v1/chat/completions", json=body, headers=trainer).raise_for_status()
        out, page = tmp_path / "batch.jsonl", tmp_path / "page.html"
        refused = CliRunner().invoke(cli, ["export", str(out), "--url", url])
        exported = CliRunner().invoke(cli, ["export", str(out), "--url", url, "--api-key", "cli-trainer-key"])
        viewed = CliRunner().invoke(
            cli, ["view", "--url", url, "--out", str(page)], env={"TOKENTAPE_API_KEY": "cli-trainer-key"}
        )
    assert refused.exit_code == 1 and "invalid_api_key" in refused.output
    assert exported.exit_code == 0, exported.output
    assert f"{out}: 1 tokentape rows" in exported.output
    assert viewed.exit_code == 0, viewed.output
    assert '"k1"' in page.read_text(encoding="utf-8")

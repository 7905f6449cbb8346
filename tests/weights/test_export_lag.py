"""`max_lag` on the HTTP exports and `tokentape export`: against the gateway's current version, a
sample with a token sampled under a version older than `current - max_lag` is dropped, or (`mask`)
kept with those tokens out of the loss; a bad value is a 400 in the OpenAI error shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tests.conftest import MODEL_NAME
from tests.support.fake_engines import serving
from tests.support.served import build
from tokentape.cli import app as cli
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.gateway.service import Gateway
from tokentape.render.renderer import Renderer
from tokentape.store.datasets import read_dataset
from tokentape.store.sqlite import SqliteStore

BODY = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def _sampled_versions(row: dict[str, Any]) -> list[int]:
    """The versions of a tokentape row's sampled tokens, read from its own fields."""
    return [v for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m and v >= 0]


async def _two_versions(admin: httpx.AsyncClient, adapters: list[Path]) -> None:
    """Session `old`: a turn at version 0; then version 2 (an adapter); session `new`: a turn at 2."""
    assert (await admin.post("/sessions/old/v1/chat/completions", json=BODY)).status_code == 200
    update = await admin.post("/admin/weights", json={"version": 2, "lora": str(adapters[0])})
    assert update.status_code == 200, update.text
    assert (await admin.post("/sessions/new/v1/chat/completions", json=BODY)).status_code == 200


async def test_max_lag_drops_or_masks_against_the_current_version(
    fresh: Gateway, admin: httpx.AsyncClient, adapters: list[Path]
) -> None:
    await _two_versions(admin, adapters)
    everything = (await admin.get("/export", params={"format": "tokentape"})).json()["data"]
    by_id = {row["session_id"]: row for row in everything}
    assert set(by_id) == {"old", "new"}
    assert set(_sampled_versions(by_id["old"])) == {0} and set(_sampled_versions(by_id["new"])) == {2}
    for lag, kept in ((0, {"new"}), (1, {"new"}), (2, {"old", "new"})):  # too old: v < 2 - lag
        rows = (await admin.get("/export", params={"format": "tokentape", "max_lag": lag})).json()["data"]
        assert {row["session_id"] for row in rows} == kept, lag
    masked = (await admin.get("/export", params={"format": "tokentape", "max_lag": 1, "lag_mode": "mask"})).json()
    old = next(row for row in masked["data"] if row["session_id"] == "old")
    assert old["masked_by_lag"] == len(_sampled_versions(by_id["old"])) > 0
    assert sum(old["loss_mask"]) == 0 and old["tokens"] == by_id["old"]["tokens"]
    new = next(row for row in masked["data"] if row["session_id"] == "new")
    assert new["loss_mask"] == by_id["new"]["loss_mask"]
    # one session, native and in a format
    native = (await admin.get("/sessions/old/export", params={"max_lag": 1})).json()
    assert native["branches"] == []
    assert len((await admin.get("/sessions/old/export", params={"max_lag": 2})).json()["branches"]) == 1
    native = (await admin.get("/sessions/old/export", params={"max_lag": 0, "lag_mode": "mask"})).json()
    (branch,) = native["branches"]
    assert sum(branch["loss_mask"]) == 0 and branch["masked_by_lag"] == old["masked_by_lag"]
    rows = (await admin.get("/sessions/old/export", params={"format": "verifiers", "max_lag": 0})).json()["data"]
    assert rows == []
    rows = (
        await admin.get("/sessions/old/export", params={"format": "verifiers", "max_lag": 0, "lag_mode": "mask"})
    ).json()["data"]
    assert sum(rows[0]["completion_mask"]) == 0 and rows[0]["masked_by_lag"] == old["masked_by_lag"]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"max_lag": "-1"}, "max_lag"),
        ({"max_lag": "two"}, "max_lag"),
        ({"max_lag": "1.5"}, "max_lag"),
        ({"max_lag": "1", "lag_mode": "keep"}, "lag_mode"),
        ({"lag_mode": "mask"}, "lag_mode"),
        ({"max_lag": "1", "lag_mode": "mask", "format": "openrlhf"}, "lag_mode"),
    ],
)
async def test_a_bad_max_lag_is_a_400_naming_it(
    fresh: Gateway, admin: httpx.AsyncClient, query: dict[str, str], param: str
) -> None:
    assert (await admin.post("/sessions/s/v1/chat/completions", json=BODY)).status_code == 200
    for path in ("/export", "/sessions/s/export"):
        refused = await admin.get(path, params=query)
        assert refused.status_code == 400, (path, refused.text)
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param


def test_the_cli_export_passes_max_lag_on(tmp_path: Path, engine: LlamaCppEngine, renderer: Renderer) -> None:
    with serving(build(engine, renderer, store=SqliteStore(tmp_path / "store.sqlite3")).app) as url:
        body: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
        httpx.post(f"{url}/sessions/early/v1/chat/completions", json=body).raise_for_status()
        # a trainer that pushed its weights itself: only the recorded version moves (the engine keeps its own)
        httpx.post(f"{url}/admin/pause").raise_for_status()
        httpx.post(f"{url}/admin/resume", json={"policy_version": 3}).raise_for_status()
        httpx.post(f"{url}/sessions/late/v1/chat/completions", json=body).raise_for_status()
        out = tmp_path / "lagged.jsonl"
        result = CliRunner().invoke(cli, ["export", str(out), "--url", url, "--max-lag", "2"])
        masked_out = tmp_path / "masked.jsonl"
        masked = CliRunner().invoke(
            cli, ["export", str(masked_out), "--url", url, "--max-lag", "2", "--lag-mode", "mask"]
        )
        refused = CliRunner().invoke(
            cli, ["export", str(tmp_path / "x.jsonl"), "--url", url, "--max-lag", "1", "--lag-mode", "sideways"]
        )
    assert result.exit_code == 0, result.output
    assert [row["session_id"] for row in read_dataset(out)] == ["late"]
    assert masked.exit_code == 0, masked.output
    rows = {row["session_id"]: row for row in read_dataset(masked_out)}
    assert set(rows) == {"early", "late"}
    assert sum(rows["early"]["loss_mask"]) == 0 and sum(rows["late"]["loss_mask"]) > 0
    assert refused.exit_code == 1 and "lag_mode must be drop or mask" in refused.output
    assert not (tmp_path / "x.jsonl").exists()

"""Rewards, groups, metadata and finishing over HTTP; exports in every format, filtered."""

from __future__ import annotations

import io
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from tests.conftest import MODEL_NAME


async def _turn(http: httpx.AsyncClient, session: str, text: str = "Hi") -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
    response = await http.post(f"/sessions/{session}/v1/chat/completions", json=body)
    return {"status": response.status_code, **response.json()}


async def test_reward_group_metadata_and_finish(http: httpx.AsyncClient) -> None:
    created = await http.post("/sessions", json={"session_id": "ep", "group_id": "g7", "metadata": {"task": 3}})
    assert created.status_code == 201 and created.json()["group_id"] == "g7"
    await _turn(http, "ep")
    summary = (await http.post("/sessions/ep/reward", json={"reward": 0.75, "turn_rewards": {"0": 1.0}})).json()
    assert (summary["reward"], summary["turn_rewards"]) == (0.75, {"0": 1.0})
    finished = (await http.post("/sessions/ep/finish", json={"metadata": {"score_note": "ok"}})).json()
    assert finished["finished"] and finished["metadata"] == {"task": 3, "score_note": "ok"}
    late = await _turn(http, "ep", "Again?")
    assert late["status"] == 409 and late["error"]["code"] == "session_finished"
    assert (await http.get("/sessions/ep")).json()["turns"] == 1
    (branch,) = (await http.get("/sessions/ep/export")).json()["branches"]
    assert branch["reward"] == 0.75


@pytest.mark.parametrize(
    "body",
    [
        {"reward": "high"},
        {"reward": float("inf")},
        {"turn_rewards": {"99": 1.0}},
        {"branch_rewards": [1]},
        {},
        {"reward": True},
    ],
    ids=["string", "infinite", "unknown turn", "not an object", "nothing", "boolean"],
)
async def test_bad_rewards_are_rejected_and_change_nothing(http: httpx.AsyncClient, body: dict[str, Any]) -> None:
    await _turn(http, "r")
    await http.post("/sessions/r/reward", json={"reward": 0.5})
    response = await http.request(
        "POST", "/sessions/r/reward", content=_json(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert (await http.get("/sessions/r")).json()["reward"] == 0.5


def _json(body: dict[str, Any]) -> bytes:
    import json

    return json.dumps(body, allow_nan=True).encode()


async def test_export_many_filters_and_outputs(http: httpx.AsyncClient) -> None:
    for name, group in [("a1", "A"), ("a2", "A"), ("b1", "B")]:
        await http.post("/sessions", json={"session_id": name, "group_id": group})
        await _turn(http, name)
    await http.post("/sessions/a1/finish")
    rows = (await http.get("/export", params={"format": "openrlhf", "group_id": "A"})).json()["data"]
    assert sorted(r["session_id"] for r in rows) == ["a1", "a2"]
    done = (await http.get("/export", params={"finished": "true"})).json()["data"]
    assert [r["session_id"] for r in done] == ["a1"]
    groups = (await http.get("/export", params={"format": "atropos"})).json()["data"]
    assert {g["group_id"]: len(g["tokens"]) for g in groups} == {"A": 2, "B": 1}
    parquet = await http.get("/export", params={"format": "verifiers", "output": "parquet"})
    table = pq.read_table(io.BytesIO(parquet.content))
    assert table.num_rows == 3 and table.schema.metadata[b"tokentape.format"] == b"verifiers"
    jsonl = await http.get("/export", params={"format": "stepwise", "output": "jsonl"})
    assert len(jsonl.text.strip().splitlines()) == 3
    for bad in ({"format": "csv"}, {"output": "xml"}, {"finished": "maybe"}, {"since": "yesterday"}):
        response = await http.get("/export", params=bad)
        assert response.status_code == 400, bad

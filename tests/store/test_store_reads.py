"""Reading the store back: one corrupt session never breaks the others (a hand-damaged SQLite
file), listings page with a cursor, exports stream a page at a time and equal the dataset built
from every session at once, several stores merge into one export, idle sessions leave memory on
a timer."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.parquet as pq
import pytest

from tests.conftest import MODEL_NAME
from tests.store.test_store_writes import _turn
from tests.support.served import build
from tokentape.core.formats import FORMATS, format_rows, samples_of
from tokentape.core.session import SessionTree
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.errors import StoreFailure
from tokentape.gateway.sessions import MemoryLimits, SessionRegistry
from tokentape.render.renderer import Renderer
from tokentape.store import export as store_export
from tokentape.store.datasets import parquet_rows
from tokentape.store.export import dataset_pages, encode_dataset
from tokentape.store.scan import SessionFilter, StoredSession, merge
from tokentape.store.sqlite import SqliteStore


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def _chat(http: httpx.AsyncClient, session: str, turns: int) -> None:
    messages: list[dict[str, Any]] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}"})
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 3, "seed": i}
        response = await http.post(f"/sessions/{session}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})


def _parquet_rows(data: bytes) -> list[dict[str, Any]]:
    return parquet_rows(pq.read_table(io.BytesIO(data)))


async def test_one_corrupt_session_never_breaks_the_others(
    tmp_path: Path, engine: LlamaCppEngine, renderer: Renderer
) -> None:
    path = tmp_path / "store.sqlite3"
    built = build(engine, renderer, store=SqliteStore(path))
    registry = built.gateway.sessions
    async with _client(built.app) as http:
        for session in ("good", "orphan", "garbled"):
            await _chat(http, session, 2)
        good_export = (await http.get("/sessions/good/export")).json()
        good_rows = (await http.get("/export", params={"prefix": "good"})).json()["data"]
    await registry.aclose()
    # damage the file by hand: a turn whose parent is gone (a lost write), a blob cut short
    db = sqlite3.connect(path)
    db.execute("DELETE FROM turns WHERE session_id = 'orphan' AND id = 0")
    db.execute("UPDATE turns SET sampled = x'010203' WHERE session_id = 'garbled' AND id = 1")
    db.commit()
    db.close()

    built = build(engine, renderer, store=SqliteStore(path))
    registry = built.gateway.sessions
    async with _client(built.app) as http:
        listed = await http.get("/sessions")
        assert listed.status_code == 200
        entries = {entry["session_id"]: entry for entry in listed.json()["data"]}
        assert set(entries) == {"good", "orphan", "garbled"}
        assert entries["good"]["turns"] == 2 and "error" not in entries["good"]
        for bad in ("orphan", "garbled"):
            assert entries[bad]["error"]["code"] == "session_corrupt" and bad in entries[bad]["error"]["message"]
        assert "parent turn 0" in entries["orphan"]["error"]["message"]

        exported = await http.get("/export")
        assert exported.status_code == 200
        assert exported.json()["data"] == good_rows
        assert {s["session_id"] for s in exported.json()["skipped"]} == {"orphan", "garbled"}
        lines = (await http.get("/export", params={"output": "jsonl"})).content.splitlines()
        assert [orjson.loads(line) for line in lines] == good_rows
        parquet = await http.get("/export", params={"output": "parquet"})
        assert parquet.status_code == 200 and _parquet_rows(parquet.content) == good_rows

        assert (await http.get("/sessions/good/export")).json() == good_export
        own = await http.get("/sessions/orphan/export")
        assert own.status_code == 500 and own.json()["error"]["code"] == "session_corrupt"
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        extend = await http.post("/sessions/orphan/v1/chat/completions", json=body)
        assert extend.status_code == 500 and extend.json()["error"]["code"] == "session_corrupt"

        assert (await http.delete("/sessions/orphan")).status_code == 200
        assert [e["session_id"] for e in (await http.get("/sessions")).json()["data"]] == ["good", "garbled"]
    await registry.aclose()
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM turns WHERE session_id = 'garbled'").fetchone() == (2,)
    db.close()


async def test_listing_pages_with_a_cursor(engine: LlamaCppEngine, renderer: Renderer) -> None:
    names = [f"p{i}" for i in range(7)]
    built = build(engine, renderer)
    registry = built.gateway.sessions
    async with _client(built.app) as http:
        for name in names:
            assert (await http.post("/sessions", json={"session_id": name})).status_code == 201
        seen: list[str] = []
        cursor = None
        pages = 0
        while True:
            params = {"limit": "3", **({"cursor": cursor} if cursor else {})}
            page = (await http.get("/sessions", params=params)).json()
            pages += 1
            seen += [entry["session_id"] for entry in page["data"]]
            assert page["has_more"] == (page["next_cursor"] is not None)
            if not page["has_more"]:
                break
            cursor = page["next_cursor"]
        assert (seen, pages) == (names, 3)
        everything = (await http.get("/sessions")).json()
        assert [entry["session_id"] for entry in everything["data"]] == names and everything["has_more"] is False
        for params in ({"limit": "0"}, {"limit": "x"}, {"limit": "1001"}, {"cursor": "not-a-cursor"}):
            bad = await http.get("/sessions", params=params)
            assert bad.status_code == 400 and bad.json()["error"]["param"] in ("limit", "cursor")
    await registry.aclose()


@pytest.mark.parametrize("fmt", FORMATS)
async def test_exports_stream_in_pages_and_equal_the_whole_dataset(
    fmt: str, engine: LlamaCppEngine, renderer: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_export, "SESSIONS_PER_PAGE", 2)
    plan = [("a1", "g1", 1), ("b1", None, None), ("a2", "g2", 0.25), ("c1", "g1", None), ("d1", "g2", 0.5)]
    built = build(engine, renderer)
    registry = built.gateway.sessions
    async with _client(built.app) as http:
        for session, group, reward in plan:
            created = {"session_id": session, "group_id": group, **({"reward": reward} if reward is not None else {})}
            assert (await http.post("/sessions", json=created)).status_code == 201
            await _chat(http, session, 2)
        # the whole dataset built at once from every session, independently of the streaming path
        trees = [t for t in [await registry.store.load(s) for s, _, _ in plan] if t is not None]
        expected = json.loads(orjson.dumps(format_rows(samples_of(trees), fmt)))  # type: ignore[arg-type]
        streamed = await http.get("/export", params={"format": fmt})
        assert streamed.json()["data"] == expected
        lines = (await http.get("/export", params={"format": fmt, "output": "jsonl"})).content.splitlines()
        assert [orjson.loads(line) for line in lines] == expected
        parquet = (await http.get("/export", params={"format": fmt, "output": "parquet"})).content
        assert _parquet_rows(parquet) == expected
        assert pq.read_metadata(io.BytesIO(parquet)).metadata[b"tokentape.format"] == fmt.encode()
        grouped = (await http.get("/export", params={"format": fmt, "group_id": "g1"})).json()["data"]
        assert {r.get("session_id") or tuple(r["session_ids"]) for r in grouped} <= {"a1", "c1", ("a1", "c1")}
    await registry.aclose()


async def test_several_stores_merge_into_one_export(tmp_path: Path) -> None:
    shards = [SqliteStore(tmp_path / f"shard{i}.sqlite3") for i in range(3)]
    trees = []
    for i in range(10):
        tree = SessionTree(f"s{i}", created_at=100.0 + i)
        tree.outcome.group_id = f"g{i % 2}"
        for sampled in ([i, 1], [i, 2]):
            assert await shards[i % 3].save_turn(tree, _turn(tree, sampled))
        trees.append(tree)
    for node in trees[4].nodes:  # a copy of one session in a second shard is exported once
        assert await shards[0].save_turn(trees[4], node)

    def scan(where: SessionFilter) -> Any:
        return merge(*(shard.scan(where, page_size=2) for shard in shards))

    merged = [stored.session_id async for stored in scan(SessionFilter())]
    assert merged == [f"s{i}" for i in range(10)]
    for fmt in ("tokentape", "atropos"):
        skipped: list[StoredSession] = []
        chunks = encode_dataset(dataset_pages(scan, SessionFilter(), fmt, skipped), fmt, "jsonl", skipped)  # type: ignore[arg-type]
        rows = [orjson.loads(line) for line in b"".join([c async for c in chunks]).splitlines()]
        assert rows == json.loads(orjson.dumps(format_rows(samples_of(trees), fmt)))  # type: ignore[arg-type]
    for shard in shards:
        shard.close()


async def test_idle_sessions_leave_memory_on_a_timer_and_running_ones_stay() -> None:
    registry = SessionRegistry(SqliteStore(":memory:"), limits=MemoryLimits(idle_seconds=0.05, evict_every=0.05))
    await registry.open("idle")
    busy, _ = await registry.open("busy")
    busy.in_flight = 1
    assert len(registry) == 2
    await asyncio.sleep(0.3)  # no request comes: the timer alone evicts
    assert registry.in_memory("idle") is None and registry.in_memory("busy") is busy
    assert registry.evicted == 1
    await registry.aclose()


async def test_the_registry_closes_the_store_it_was_given(tmp_path: Path) -> None:
    """The registry owns its store: closing the registry commits what was queued, checkpoints the
    log into the database file and stops the store's threads; later writes are refused."""
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    registry = SessionRegistry(store)
    session, created = await registry.open("kept")
    assert created
    await registry.persist(session)
    threads = {store._writer, store._reader}
    assert all(thread.is_alive() for thread in threads)
    await registry.aclose()
    assert not any(thread.is_alive() for thread in threads)
    with pytest.raises(StoreFailure, match="closed"):
        await store.save_session(session.tree)
    wal = Path(f"{path}-wal")
    assert not wal.exists() or wal.stat().st_size == 0  # checkpointed: the database file holds every commit
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT id FROM sessions").fetchall() == [("kept",)]

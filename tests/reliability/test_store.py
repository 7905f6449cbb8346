"""Nothing lost: turns survive restarts and kill -9, deleted sessions stay deleted, evicted sessions
still export."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.gateway.sessions import MemoryLimits
from tokentape.launcher import running_server
from tokentape.render.renderer import Renderer
from tokentape.store.sqlite import SqliteStore


async def _turns(
    base: str, session: str, count: int, messages: list[Any], http: httpx.AsyncClient | None = None
) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=f"{base}/sessions/{session}/v1", api_key="x", max_retries=0, http_client=http)
    for i in range(count):
        messages.append({"role": "user", "content": f"Question {len(messages)}"})
        reply = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, seed=i)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return messages


async def test_turns_survive_kill_minus_nine_and_sessions_keep_extending(
    tmp_path: Path, engine: LlamaCppEngine, renderer: Renderer
) -> None:
    store = tmp_path / "store.sqlite3"
    args = ["--store", str(store), "--context-length", "2048"]
    with running_server(args) as server:
        messages = await _turns(server.base_url, "durable", 2, [])
        before = httpx.get(f"{server.base_url}/sessions/durable/export").json()
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
    # restarted on the same store: a gateway in this process, on the shared model (the same weights
    # `tokentape serve` loads), instead of a second `tokentape serve`
    built = build(engine, renderer, store=SqliteStore(store))
    transport = httpx.ASGITransport(app=built.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        after = (await http.get("/sessions/durable/export")).json()
        assert after["branches"] == before["branches"]
        await _turns("http://t", "durable", 1, messages, http)
        summary = (await http.get("/sessions/durable")).json()
        assert (summary["turns"], summary["branches"], summary["rewrites"]) == (3, 1, 0)
        (branch,) = (await http.get("/sessions/durable/export")).json()["branches"]
        assert branch["tokens"][: len(before["branches"][0]["tokens"])] == before["branches"][0]["tokens"]
    built.gateway.sessions.store.close()


async def test_deleted_sessions_stay_deleted(tmp_path: Path, engine: LlamaCppEngine, renderer: Renderer) -> None:
    path = tmp_path / "store.sqlite3"
    built = build(engine, renderer, store=SqliteStore(path))
    app, registry = built.app, built.gateway.sessions
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        assert (await http.post("/sessions/gone/v1/chat/completions", json=body)).status_code == 200
        tree = (await registry.get("gone")).tree
        assert (await http.delete("/sessions/gone")).status_code == 200
        # a late write for the deleted session (a turn that was still running) is refused
        assert not await registry.store.save_turn(tree, tree.nodes[0])
        again = await http.post("/sessions/gone/v1/chat/completions", json=body)
        assert again.status_code == 409 and again.json()["error"]["code"] == "session_deleted"
    registry.store.close()
    reopened = SqliteStore(path)
    assert await reopened.load("gone") is None and await reopened.is_deleted("gone")
    reopened.close()


async def test_evicted_sessions_reload_and_export(engine: LlamaCppEngine, renderer: Renderer) -> None:
    built = build(engine, renderer, memory=MemoryLimits(max_sessions=2))
    app, registry = built.app, built.gateway.sessions
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        for i in range(6):
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 3}
            assert (await http.post(f"/sessions/s{i}/v1/chat/completions", json=body)).status_code == 200
            await http.post(f"/sessions/s{i}/finish")
        assert len(registry) <= 3 and registry.evicted >= 3
        exported = (await http.get("/export")).json()["data"]
        assert sorted(r["session_id"] for r in exported) == [f"s{i}" for i in range(6)]
        assert (await http.get("/sessions/s0/export")).json()["summary"]["turns"] == 1

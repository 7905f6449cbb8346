"""SIGTERM drains: the request in flight finishes and is stored, then the process exits cleanly."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx

from tests.conftest import MODEL_NAME
from tokentape.core.tape import path_tokens
from tokentape.launcher import running_server
from tokentape.store.sqlite import SqliteStore


async def _generating(http: httpx.AsyncClient, timeout: float = 30.0) -> bool:
    """Whether, within `timeout` seconds, the server has a request in flight and has sampled tokens."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        health = (await http.get("/health")).json()
        if health["requests_active"] == 1 and (health["tokens_generated"] or 0) > 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    args = ["--store", str(tmp_path / "store.sqlite3"), "--context-length", "2048"]
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell a story."}],
        "max_tokens": 120,
        "seed": 3,
    }
    with running_server(args) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            pending = asyncio.create_task(http.post("/sessions/drain/v1/chat/completions", json=body))
            # SIGTERM only once the request is generating (the gateway admitted it and the engine has
            # sampled from it), so that the drain has something to drain
            assert await _generating(http), "the request never started generating"
            assert not pending.done()
            server.process.send_signal(signal.SIGTERM)
            response = await pending
        assert response.status_code == 200
        # uvicorn drains, closes the app (the store checkpoints), then re-raises the signal it caught
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM)
        wal = tmp_path / "store.sqlite3-wal"
        assert not wal.exists() or wal.stat().st_size == 0  # the store was closed: WAL checkpointed
    # the drained turn is in the store, read as a restarted gateway reads it (without starting one)
    store = SqliteStore(tmp_path / "store.sqlite3")
    try:
        tree = await store.load("drain")
    finally:
        store.close()
    assert tree is not None and tree.summary()["turns"] == 1
    (leaf,) = tree.nodes
    token_ids = response.json()["choices"][0]["token_ids"]
    assert path_tokens(leaf)[-len(token_ids) :] == token_ids

"""A turn is durable before anything can replay it. A client that gives up while its turn is being
written, then retried by its SDK (`x-stainless-retry-count: 1`), gets the recorded answer only once
the turn is in the store, and the turn survives a restart.

The gateway runs in uvicorn on a loopback port (a real disconnect, as a client's timeout makes it)
with the real embedded engine and a real SQLite file; the store's writes wait on a gate the test
opens, which is how a busy disk looks to the gateway.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.support.fake_engines import serving
from tests.support.gates import NoticesDisconnects
from tests.support.served import build
from tokentape.core.images import DecodedImage
from tokentape.core.session import SessionTree
from tokentape.core.tape import TurnNode
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer
from tokentape.store.sqlite import SqliteStore
from tokentape.store.writer import Write

T = TypeVar("T")

BODY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 6,
    "temperature": 1.0,
    "seed": 11,
}
RETRY = {"x-stainless-retry-count": "1"}


class SlowStore(SqliteStore):
    """A store whose turn writes wait in its writer thread until the test opens the gate (a slow disk)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._commit_inline = False  # every write goes to the writer thread, which waits there
        self.entered = threading.Event()  # a turn write has started waiting
        self.gate = threading.Event()
        self._turn_write = False

    def save_turn(
        self,
        tree: SessionTree,
        node: TurnNode,
        request_key: bytes | None = None,
        images: Mapping[str, DecodedImage] | None = None,
    ) -> Write[bool]:
        self._turn_write = True
        try:
            return super().save_turn(tree, node, request_key, images)
        finally:
            self._turn_write = False

    def _write(self, apply: Callable[[sqlite3.Connection], T], what: str) -> Write[T]:
        if not self._turn_write:
            return super()._write(apply, what)

        def slowly(db: sqlite3.Connection) -> T:
            self.entered.set()
            self.gate.wait(60)
            return apply(db)

        return super()._write(slowly, what)


Slow = tuple[str, SlowStore, threading.Event]  # the gateway's URL, its store, "it saw the client leave"


@pytest.fixture
def slow(tmp_path: Path, engine: LlamaCppEngine, renderer: Renderer) -> Iterator[Slow]:
    store = SlowStore(tmp_path / "store.sqlite3")
    app = NoticesDisconnects(build(engine, renderer, store=store).app)
    with serving(app) as url:  # type: ignore[arg-type]
        yield url, store, app.noticed
    store.gate.set()
    store.close()


def _stored_turns(path: Path, session_id: str) -> list[tuple[int, bytes]]:
    """The turn rows as SQLite has them, read over a connection of our own."""
    with sqlite3.connect(path) as db:
        return list(db.execute("SELECT id, sampled FROM turns WHERE session_id = ? ORDER BY id", (session_id,)))


async def _abandon_during_write(slow: Slow, path: str) -> None:
    """Send a request and leave (close the connection) while its turn is being written; return once
    the gateway has seen the client go."""
    url, store, noticed = slow
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        first = asyncio.create_task(http.post(path, json=BODY))
        assert await asyncio.to_thread(store.entered.wait, 60), "the turn write never started"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    assert await asyncio.to_thread(noticed.wait, 30), "the gateway never saw the client leave"


async def test_an_abandoned_write_still_lands_and_its_retry_survives_a_restart(slow: Slow, tmp_path: Path) -> None:
    url, store, _ = slow
    path = "/sessions/abandoned/v1/chat/completions"
    await _abandon_during_write(slow, path)
    store.gate.set()  # the disk catches up after the client has gone
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        retried = await http.post(path, json=BODY, headers=RETRY)
        assert retried.status_code == 200, retried.text
        ids = retried.json()["choices"][0]["token_ids"]
        turns = (await http.get("/sessions/abandoned")).json()["turns"]
    assert turns == 1  # replayed, not sampled again
    # a restart reads SQLite: the acknowledged turn is there, with the tokens the retry was given
    reopened = SqliteStore(tmp_path / "store.sqlite3")
    reloaded = await reopened.load("abandoned")
    reopened.close()
    assert reloaded is not None and [list(n.sampled) for n in reloaded.nodes] == [ids]


async def test_a_retry_is_not_answered_before_the_turn_it_replays_is_stored(slow: Slow, tmp_path: Path) -> None:
    url, store, _ = slow
    path = "/sessions/early/v1/chat/completions"
    await _abandon_during_write(slow, path)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        retry = asyncio.create_task(http.post(path, json=BODY, headers=RETRY))
        done, _ = await asyncio.wait({retry}, timeout=1.5)
        assert not done, "the retry was answered while its turn was not yet in the store"
        store.gate.set()
        retried = await retry
    assert retried.status_code == 200, retried.text
    stored = _stored_turns(tmp_path / "store.sqlite3", "early")
    assert len(stored) == 1

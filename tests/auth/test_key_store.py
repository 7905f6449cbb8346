"""The store keeps a session key's digest in one column of the sessions table, and a store written
before that column existed gains it when opened."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path

from tokentape.core.session import SessionTree
from tokentape.store.sqlite import SqliteStore

OLD_SESSIONS = """CREATE TABLE sessions (id TEXT PRIMARY KEY, policy TEXT NOT NULL, created_at REAL NOT NULL,
outcome TEXT NOT NULL, deleted INTEGER NOT NULL DEFAULT 0);
INSERT INTO sessions VALUES ('old', 'tape', 1.0, '{}', 0);"""


async def test_a_store_from_before_keys_gains_the_column_and_keeps_its_sessions(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SESSIONS)
    store = SqliteStore(path)
    try:
        assert await store.key_state("old") is None  # no key: it predates them
        assert (await store.load("old")) is not None
        tree = SessionTree("new", "tape", created_at=time.time())
        digest = hashlib.sha256(b"a key").digest()
        assert await store.save_session_key(tree, digest)
        assert await store.key_state("new") == (digest, False, False)
        tree.outcome.finished_at = time.time()
        assert await store.save_session(tree)
        assert await store.key_state("new") == (digest, True, False)  # a row update keeps the digest
        await store.delete("new")
        assert await store.key_state("new") == (digest, True, True)
        assert not await store.save_session_key(tree, digest)  # a deleted session takes no key
    finally:
        store.close()
    with sqlite3.connect(path) as db:
        columns = [row[1] for row in db.execute("PRAGMA table_info(sessions)")]
    assert columns.count("key_hash") == 1

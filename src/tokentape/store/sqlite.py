"""The trajectory store: SQLite in WAL mode, one file per gateway process.

Writes: one writer thread owns the writing connection. `save_turn`, `save_session` and `delete`
queue their job the moment they are called and return a `Write`; the writer takes every job
waiting and commits them in one transaction (group commit: while one commit runs, the next batch
gathers). Awaiting a `Write` returns after that job's own commit, or raises `StoreFailure` if it was
not committed. Cancelling the awaiting task never cancels the write: the job is already queued
and the await is shielded, so a client that gives up cannot lose its own turn. A batch in which
anything fails is rolled back and its jobs retried one transaction each, so a failing job fails
alone and the others commit.

The tables, their statements and the rows of sessions and turns are declared once, column by column,
in `schema.py`; the threads and their group commit are `writer.py`.

Reads (`load`, `is_deleted`, `keys`, `load_many`, `scan`, `read_images`) run on a reader thread with
its own connection (WAL lets it read while the writer commits), never on the event loop. A ":memory:"
store has one connection, so its reads queue on the writer thread. A session loads with its images'
facts only; their bytes, stored once per distinct image, are read by digest (`read_images`, through
`images.ImageLibrary`).

A deleted session leaves a tombstone: no late write brings it back. A session whose rows cannot
be read (a turn whose parent is missing, a damaged blob) raises `StoreFailure` with code
`session_corrupt` for that session alone; scans yield it with its error and go on.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from tokentape.core.images import DecodedImage
from tokentape.core.session import SessionTree
from tokentape.core.tape import TurnNode
from tokentape.errors import StoreFailure
from tokentape.store.scan import ANY_SESSION, PAGE_SIZE, SessionFilter, SessionKey, StoredSession
from tokentape.store.schema import (
    IMAGES,
    SELECT_IMAGE_FACTS,
    SESSIONS,
    TURNS,
    decoded_image,
    image_facts,
    image_row,
    session_row,
    session_tree,
    turn_node,
    turn_row,
)
from tokentape.store.writer import BUSY_TIMEOUT_MS, STOP, Job, Worker, Write, settle_all

__all__ = ["SqliteStore", "Write", "Synchronous"]

T = TypeVar("T")
log = logging.getLogger("tokentape.store")

Synchronous = Literal["NORMAL", "FULL"]

_SCHEMA = (
    SESSIONS.ddl()
    + TURNS.ddl()
    + IMAGES.ddl()
    + """DROP INDEX IF EXISTS turns_by_request;
CREATE INDEX IF NOT EXISTS sessions_in_order ON sessions (created_at, id);
"""
)
_UPSERT_SESSION = SESSIONS.upsert(where="deleted = 0")
_INSERT_TURN = TURNS.insert_or_replace()
_SELECT_TURNS = TURNS.select("session_id = ?", order="id")
_SELECT_SESSION = SESSIONS.select("id = ?")  # deleted ones too: a tombstone says so
_INSERT_IMAGE = IMAGES.insert_or_ignore()  # by content: the bytes of one image are stored once

_ID, _CREATED_AT, _DELETED = (SESSIONS.names.index(name) for name in ("id", "created_at", "deleted"))

Row = tuple[Any, ...]


# -- jobs that run in the writer's transaction -----------------------------------------------------
def _upsert_session(db: sqlite3.Connection, row: Row) -> bool:
    """Insert or update the session's row; False (nothing written) if the session was deleted."""
    return db.execute(_UPSERT_SESSION, row).rowcount > 0


def _write_turn(session: Row, turn: Row, images: Sequence[Row] = ()) -> Callable[[sqlite3.Connection], bool]:
    def apply(db: sqlite3.Connection) -> bool:
        if not _upsert_session(db, session):
            return False
        if images:  # by content: an image already stored is not stored again
            db.executemany(_INSERT_IMAGE, images)
        db.execute(_INSERT_TURN, turn)
        return True

    return apply


def _write_session_key(row: Row, digest: bytes) -> Callable[[sqlite3.Connection], bool]:
    def apply(db: sqlite3.Connection) -> bool:
        if not _upsert_session(db, row):
            return False
        db.execute("UPDATE sessions SET key_hash = ? WHERE id = ?", (digest, row[_ID]))
        return True

    return apply


def _write_tombstone(session_id: str) -> Callable[[sqlite3.Connection], None]:
    def apply(db: sqlite3.Connection) -> None:
        db.execute("DELETE FROM turns WHERE session_id = ?", (session_id,))
        db.execute(
            "INSERT INTO sessions (id, policy, created_at, outcome, deleted) VALUES (?, 'tape', 0, '{}', 1) "
            "ON CONFLICT(id) DO UPDATE SET deleted = 1",
            (session_id,),
        )

    return apply


# -- reads -------------------------------------------------------------------------------------------
def _session_row(db: sqlite3.Connection, session_id: str) -> Row | None:
    row: Row | None = db.execute(_SELECT_SESSION, (session_id,)).fetchone()
    return row


def _tree(db: sqlite3.Connection, row: Row) -> SessionTree:
    """Rebuild one session from its row and its turns' rows; any inconsistency in them raises
    `StoreFailure` (session_corrupt)."""
    session_id = row[_ID]
    try:
        tree = session_tree(row)
        for turn in db.execute(_SELECT_TURNS, (session_id,)):
            tree.restore(turn_node(tree, turn))
        _restore_images(db, tree)
    except sqlite3.Error:
        raise  # the database itself failed, not this session's rows
    except Exception as exc:
        raise StoreFailure(
            f"session {session_id!r} cannot be read from the store: {exc}", param="session_id", code="session_corrupt"
        ) from exc
    return tree


def _restore_images(db: sqlite3.Connection, tree: SessionTree) -> None:
    """The facts of the images the session's turns show (never their bytes: `read_images`)."""
    digests = sorted({run.digest for node in tree.nodes for run in node.images})
    for start in range(0, len(digests), 500):  # within SQLite's limit on bound parameters
        chunk = digests[start : start + 500]
        for row in db.execute(SELECT_IMAGE_FACTS.format(", ".join("?" * len(chunk))), chunk):
            facts = image_facts(row)
            tree.images[facts.digest] = facts
    missing = [d for d in digests if d not in tree.images]
    if missing:
        raise ValueError(f"image {missing[0]} that a turn shows is not stored")


def _read_images(db: sqlite3.Connection, digests: Sequence[str]) -> dict[str, DecodedImage]:
    found: dict[str, DecodedImage] = {}
    for start in range(0, len(digests), 500):
        chunk = digests[start : start + 500]
        for row in db.execute(IMAGES.select(f"digest IN ({', '.join('?' * len(chunk))})"), chunk):
            image = decoded_image(row)
            found[image.digest] = image
    return found


def _load(db: sqlite3.Connection, session_id: str) -> SessionTree | None:
    tree, _ = _lookup(db, session_id)
    return tree


def _lookup(db: sqlite3.Connection, session_id: str) -> tuple[SessionTree | None, bool]:
    row = _session_row(db, session_id)
    if row is None or row[_DELETED]:
        return None, bool(row)
    return _tree(db, row), False


def _load_many(db: sqlite3.Connection, session_ids: Sequence[str]) -> list[StoredSession]:
    loaded = []
    for session_id in session_ids:
        row = _session_row(db, session_id)
        if row is None or row[_DELETED]:
            continue  # deleted since it was listed
        try:
            loaded.append(StoredSession(session_id, row[_CREATED_AT], _tree(db, row)))
        except StoreFailure as exc:
            log.error("%s", exc.message)
            loaded.append(StoredSession(session_id, row[_CREATED_AT], None, exc.message))
    return loaded


def _keys(db: sqlite3.Connection, where: SessionFilter, after: SessionKey | None, limit: int) -> list[SessionKey]:
    clauses, params = ["deleted = 0"], []
    if after is not None:
        clauses.append("(created_at, id) > (?, ?)")
        params += [after[0], after[1]]
    if where.since is not None:
        clauses.append("created_at >= ?")
        params.append(where.since)
    if where.until is not None:
        clauses.append("created_at < ?")
        params.append(where.until)
    if where.prefix is not None:
        clauses.append("substr(id, 1, ?) = ?")
        params += [len(where.prefix), where.prefix]
    if where.group_id is not None:
        clauses.append("json_extract(outcome, '$.group_id') = ?")
        params.append(where.group_id)
    if where.finished is not None:
        clauses.append(f"json_extract(outcome, '$.finished_at') IS {'NOT ' if where.finished else ''}NULL")
    if where.side_calls is not None:
        clauses.append(f"json_extract(outcome, '$.metadata.side_of') IS {'NOT ' if where.side_calls else ''}NULL")
    sql = f"SELECT created_at, id FROM sessions WHERE {' AND '.join(clauses)} ORDER BY created_at, id LIMIT ?"
    return [(r[0], r[1]) for r in db.execute(sql, (*params, limit))]


def _key_state(db: sqlite3.Connection, session_id: str) -> tuple[bytes, bool, bool] | None:
    row = db.execute(
        "SELECT key_hash, json_extract(outcome, '$.finished_at') IS NOT NULL, deleted FROM sessions WHERE id = ?",
        (session_id,),
    ).fetchone()
    return None if row is None or row[0] is None else (bytes(row[0]), bool(row[1]), bool(row[2]))


def _is_deleted(db: sqlite3.Connection, session_id: str) -> bool:
    row = db.execute("SELECT deleted FROM sessions WHERE id = ?", (session_id,)).fetchone()
    return bool(row and row[0])


class SqliteStore:
    """`path` ":memory:" keeps nothing across restarts (tests, throwaway runs).

    `synchronous` is SQLite's: NORMAL (the default) makes a commit durable against a crash or
    kill -9 of this process, because in WAL mode the commit is in the operating system once
    `write` returns; it costs ~0.02 ms per commit here. FULL also survives power loss or an OS
    crash by syncing the WAL at every commit, ~5 ms per commit on this machine's disk: group
    commit shares one sync among every turn waiting, but a lone session pays it on every turn.
    """

    def __init__(self, path: str | Path, *, synchronous: Synchronous = "NORMAL") -> None:
        self.path = str(path)
        self.synchronous = synchronous
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._closed = False
        # at NORMAL a commit costs ~0.02 ms, so an idle writer's work is done on the caller's thread; at
        # FULL it waits for the disk (~5 ms), which never happens on an event loop's thread
        self._commit_inline = synchronous == "NORMAL"
        self._closing = threading.Lock()  # a job is either queued before the stop or refused
        # a ":memory:" store's data lives in its one connection: never replaced after a failure
        self._writer = Worker("store-writer", self._connect_writer, reconnect=self.path != ":memory:")
        self._writer.start()
        self._writer.ready.result()
        self._reader = self._writer
        if self.path != ":memory:":
            self._reader = Worker("store-reader", self._connect_reader)
            self._reader.start()
            self._reader.ready.result()

    def _connect_writer(self) -> sqlite3.Connection:
        # used by the writer thread, and by an event loop's thread for a write made while it is idle
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={self.synchronous}")
        db.executescript(_SCHEMA)
        for table in (SESSIONS, TURNS):  # a store written by an earlier version lacks the columns added since
            present = {row[1] for row in db.execute(f"PRAGMA table_info({table.name})")}
            for statement in table.added_since(present):
                db.execute(statement)
        return db

    def _connect_reader(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None)
        db.execute("PRAGMA query_only=ON")
        return db

    @property
    def batches(self) -> int:
        """Transactions committed so far (each holds one or more writes)."""
        return self._writer.batches

    @property
    def writes_committed(self) -> int:
        return self._writer.committed

    @property
    def queued_writes(self) -> int:
        """Jobs waiting for the writer thread (not counting the batch it is committing)."""
        return self._writer.jobs.qsize()

    def _submit(self, worker: Worker, apply: Callable[[sqlite3.Connection], T], what: str, write: bool) -> Job:
        job = Job(apply, what, write)
        with self._closing:
            if not self._closed:
                if write and self._commit_inline and worker.commit_here(job):
                    return job
                worker.queue(job)
                return job
        settle_all([(job, None, StoreFailure(f"the store could not {what}: it is closed"))])
        return job

    def _write(self, apply: Callable[[sqlite3.Connection], T], what: str) -> Write[T]:
        return Write(self._submit(self._writer, apply, what, write=True))

    async def _read(self, apply: Callable[[sqlite3.Connection], T], what: str) -> T:
        result: T = await self._submit(self._reader, apply, what, write=False).landing()
        return result

    # -- writes: queued when called; await the returned Write for the commit -----------------------
    def save_turn(
        self,
        tree: SessionTree,
        node: TurnNode,
        request_key: bytes | None = None,
        images: Mapping[str, DecodedImage] | None = None,
    ) -> Write[bool]:
        """Queue one turn and its session row, to commit together. The row is taken from `tree`
        and `node` now, on the caller's thread. `images`: the bytes of images the turn shows, by
        digest, stored once each (a digest already stored is left as it is; one not given must be
        stored already). Resolves to True once committed, False if the session was deleted
        (nothing written); raises `StoreFailure` if the write failed."""
        session_id = tree.session_id
        given = images or {}
        shown = dict.fromkeys(run.digest for run in node.images)
        rows = [image_row(given[digest]) for digest in shown if digest in given]
        job = _write_turn(session_row(tree), turn_row(session_id, node, request_key), rows)
        return self._write(job, f"write turn {node.id} of session {session_id!r}")

    def save_session(self, tree: SessionTree) -> Write[bool]:
        """Queue a session's row (creation, rewards, finish); False if the session was deleted."""
        row = session_row(tree)
        return self._write(lambda db: _upsert_session(db, row), f"write session {tree.session_id!r}")

    def save_session_key(self, tree: SessionTree, digest: bytes) -> Write[bool]:
        """Queue a session's row with the digest of its key (never the key itself); False if the
        session was deleted."""
        job = _write_session_key(session_row(tree), digest)
        return self._write(job, f"write the key of session {tree.session_id!r}")

    def delete(self, session_id: str) -> Write[None]:
        """Queue the removal of a session's turns; its tombstone refuses later writes."""
        return self._write(_write_tombstone(session_id), f"delete session {session_id!r}")

    def flush(self) -> Write[None]:
        """Resolves once every write queued before it has been committed (or has failed)."""
        return self._write(lambda db: None, "flush")

    # -- reads ---------------------------------------------------------------------------------------
    async def image_stats(self) -> dict[str, int]:
        """How many distinct images the store holds, and their bytes."""

        def count(db: sqlite3.Connection) -> dict[str, int]:
            images, size = db.execute("SELECT count(*), coalesce(sum(length(data)), 0) FROM images").fetchone()
            return {"images": int(images), "bytes": int(size)}

        return await self._read(count, "count images")

    async def read_images(self, digests: Iterable[str]) -> dict[str, DecodedImage]:
        """The stored images of `digests` with their bytes, by digest (a digest not stored is absent)."""
        wanted = sorted(set(digests))
        if not wanted:
            return {}
        return await self._read(lambda db: _read_images(db, wanted), f"read {len(wanted)} image(s)")

    async def load(self, session_id: str) -> SessionTree | None:
        """The stored session, None if there is none (or it was deleted); raises `StoreFailure`
        (session_corrupt) if its rows cannot be read."""
        return await self._read(lambda db: _load(db, session_id), f"read session {session_id!r}")

    async def lookup(self, session_id: str) -> tuple[SessionTree | None, bool]:
        """`load` and `is_deleted` in one read: (the stored session or None, whether it was deleted)."""
        return await self._read(lambda db: _lookup(db, session_id), f"read session {session_id!r}")

    async def key_state(self, session_id: str) -> tuple[bytes, bool, bool] | None:
        """The stored digest of the session's key, whether the session is finished and whether it
        was deleted; None if the session has no key (or no row)."""
        return await self._read(lambda db: _key_state(db, session_id), f"read the key of session {session_id!r}")

    async def is_deleted(self, session_id: str) -> bool:
        return await self._read(lambda db: _is_deleted(db, session_id), f"read session {session_id!r}")

    async def keys(
        self, where: SessionFilter = ANY_SESSION, *, after: SessionKey | None = None, limit: int = PAGE_SIZE
    ) -> list[SessionKey]:
        """Up to `limit` stored sessions' keys, in order, strictly after `after`."""
        return await self._read(lambda db: _keys(db, where, after, limit), "list sessions")

    async def load_many(self, session_ids: Sequence[str]) -> list[StoredSession]:
        """Several sessions in one read; an unreadable one comes back with its error, not raised."""
        ids = list(session_ids)
        return await self._read(lambda db: _load_many(db, ids), "read sessions")

    async def scan(
        self, where: SessionFilter = ANY_SESSION, *, after: SessionKey | None = None, page_size: int = PAGE_SIZE
    ) -> AsyncIterator[StoredSession]:
        """Every stored session matching `where`, in key order, read `page_size` at a time."""
        while True:
            page = await self.keys(where, after=after, limit=page_size)
            if not page:
                return
            for stored in await self.load_many([session_id for _, session_id in page]):
                yield stored
            after = page[-1]

    # -- shutdown --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Commit every queued write, checkpoint the WAL into the database file, and stop the
        threads. Writes queued after this fail with `StoreFailure`."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._writer.queue(Job(lambda db: db.execute("PRAGMA wal_checkpoint(TRUNCATE)"), "checkpoint", write=False))
            self._writer.jobs.put(STOP)
            if self._reader is not self._writer:
                self._reader.jobs.put(STOP)
        self._writer.join()
        self._reader.join()

    async def aclose(self) -> None:
        """`close` without blocking the event loop."""
        await asyncio.to_thread(self.close)

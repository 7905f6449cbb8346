"""The trajectory store: SQLite in WAL mode, one file per gateway process.

Writes: one writer thread owns the writing connection. `save_turn`, `save_session` and `delete`
queue their job the moment they are called and return a `Write`; the writer takes every job
waiting and commits them in one transaction (group commit: while one commit runs, the next batch
gathers). Awaiting a `Write` returns after that job's own commit, or raises `StoreFailure` if it was
not committed. Cancelling the awaiting task never cancels the write: the job is already queued
and the await is shielded, so a client that gives up cannot lose its own turn. A batch in which
anything fails is rolled back and its jobs retried one transaction each, so a failing job fails
alone and the others commit.

Reads (`load`, `is_deleted`, `keys`, `load_many`, `scan`) run on a reader thread with its own
connection (WAL lets it read while the writer commits), never on the event loop. A ":memory:" store
has one connection, so its reads queue on the writer thread.

A deleted session leaves a tombstone: no late write brings it back. A session whose rows cannot
be read (a turn whose parent is missing, a damaged blob) raises `StoreFailure` with code
`session_corrupt` for that session alone; scans yield it with its error and go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import sqlite3
import threading
from array import array
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from tokentape.core.outcome import Outcome
from tokentape.core.session import SessionTree
from tokentape.core.tape import Origin, Rewrite, TurnNode
from tokentape.errors import StoreFailure
from tokentape.store.scan import ANY_SESSION, SessionFilter, SessionKey, StoredSession

__all__ = ["SqliteStore", "Write", "Synchronous"]

T = TypeVar("T")
log = logging.getLogger("tokentape.store")

Synchronous = Literal["NORMAL", "FULL"]
MAX_BATCH = 256  # jobs per transaction: bounds how long one commit holds the first job's caller
PAGE_SIZE = 64  # sessions per read when scanning: bounds the memory of a listing or an export
BUSY_TIMEOUT_MS = 5000  # how long the writer thread waits for another connection's write lock

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    policy TEXT NOT NULL,
    created_at REAL NOT NULL,
    outcome TEXT NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0,
    key_hash BLOB
);
CREATE TABLE IF NOT EXISTS turns (
    session_id TEXT NOT NULL,
    id INTEGER NOT NULL,
    parent INTEGER,
    keep INTEGER NOT NULL,
    context BLOB NOT NULL,
    context_origin INTEGER NOT NULL,
    sampled BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    finish_reason TEXT NOT NULL,
    prompt_chain BLOB NOT NULL,
    chain BLOB NOT NULL,
    message_count INTEGER NOT NULL,
    reply TEXT NOT NULL,
    rewrite TEXT,
    request_key BLOB,
    policy_version TEXT,
    request_no INTEGER,
    trace_id TEXT,
    logprob_mode TEXT,
    template_inputs TEXT,
    constrained INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, id)
);
DROP INDEX IF EXISTS turns_by_request;
CREATE INDEX IF NOT EXISTS sessions_in_order ON sessions (created_at, id);
"""

_TURN_COLUMNS = (
    "session_id, id, parent, keep, context, context_origin, sampled, logprobs, finish_reason, "
    "prompt_chain, chain, message_count, reply, rewrite, request_key, policy_version, request_no, trace_id, "
    "logprob_mode, template_inputs, constrained"
)
_INSERT_TURN = f"INSERT OR REPLACE INTO turns ({_TURN_COLUMNS}) VALUES ({', '.join('?' * 21)})"
_ADDED_TURN_COLUMNS = (  # absent from earlier stores
    ("request_no", "INTEGER"),
    ("trace_id", "TEXT"),
    ("logprob_mode", "TEXT"),
    ("template_inputs", "TEXT"),
    ("constrained", "INTEGER NOT NULL DEFAULT 0"),
)
_ADDED_SESSION_COLUMNS = (("key_hash", "BLOB"),)  # the SHA-256 of the session's key; absent from earlier stores
_SELECT_TURNS = f"SELECT {_TURN_COLUMNS} FROM turns WHERE session_id = ? ORDER BY id"

SessionRow = tuple[str, str, float, str]  # id, policy, created_at, outcome JSON


def _ints(values: Sequence[int]) -> bytes:
    return array("q", values).tobytes()


def _floats(values: Sequence[float]) -> bytes:
    return array("d", values).tobytes()


def _unints(blob: bytes) -> tuple[int, ...]:
    out = array("q")
    out.frombytes(blob)
    return tuple(out)


def _unfloats(blob: bytes) -> tuple[float, ...]:
    out = array("d")
    out.frombytes(blob)
    return tuple(out)


def _inputs_json(node: TurnNode) -> str | None:
    """A turn's template inputs; NULL when it shares its parent's (long episodes store them once)."""
    if node.parent is not None and node.template_inputs is node.parent.template_inputs:
        return None
    return json.dumps(node.template_inputs) if node.template_inputs is not None or node.parent else None


def _inputs_of(saved: str | None, parent: TurnNode | None) -> Any:
    if saved is None:
        return parent.template_inputs if parent is not None else None
    return json.loads(saved)


def _outcome_json(outcome: Outcome) -> str:
    return json.dumps(
        {
            "group_id": outcome.group_id,
            "metadata": outcome.metadata,
            "reward": outcome.reward,
            "branch_rewards": outcome.branch_rewards,
            "turn_rewards": outcome.turn_rewards,
            "finished_at": outcome.finished_at,
        }
    )


def _session_row(tree: SessionTree) -> SessionRow:
    return (tree.session_id, tree.policy, tree.outcome.created_at, _outcome_json(tree.outcome))


def _turn_row(session_id: str, node: TurnNode, request_key: bytes | None) -> tuple[Any, ...]:
    return (
        session_id,
        node.id,
        node.parent.id if node.parent is not None else None,
        node.keep,
        _ints(node.context),
        int(node.context_origin),
        _ints(node.sampled),
        _floats(node.logprobs),
        node.finish_reason,
        node.prompt_chain,
        node.chain,
        node.message_count,
        json.dumps(dict(node.reply)),
        json.dumps(node.rewrite.as_dict()) if node.rewrite else None,
        request_key,
        node.policy_version,
        node.request,
        node.trace_id,
        node.logprob_mode,
        _inputs_json(node),
        int(node.constrained),
    )


# -- jobs that run in the writer's transaction -----------------------------------------------------
def _upsert_session(db: sqlite3.Connection, row: SessionRow) -> bool:
    """Insert or update the session's row; False (nothing written) if the session was deleted."""
    written = db.execute(
        "INSERT INTO sessions (id, policy, created_at, outcome) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(id) DO UPDATE SET policy = excluded.policy, outcome = excluded.outcome WHERE deleted = 0",
        row,
    )
    return written.rowcount > 0


def _write_turn(session: SessionRow, turn: tuple[Any, ...]) -> Callable[[sqlite3.Connection], bool]:
    def apply(db: sqlite3.Connection) -> bool:
        if not _upsert_session(db, session):
            return False
        db.execute(_INSERT_TURN, turn)
        return True

    return apply


def _write_session_key(row: SessionRow, digest: bytes) -> Callable[[sqlite3.Connection], bool]:
    def apply(db: sqlite3.Connection) -> bool:
        if not _upsert_session(db, row):
            return False
        db.execute("UPDATE sessions SET key_hash = ? WHERE id = ?", (digest, row[0]))
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
def _tree(db: sqlite3.Connection, session_id: str, policy: str, created_at: float, outcome_json: str) -> SessionTree:
    """Rebuild one session; any inconsistency in its rows raises `StoreFailure` (session_corrupt)."""
    try:
        tree = SessionTree(session_id, policy, created_at=created_at)  # type: ignore[arg-type]
        saved = json.loads(outcome_json)
        outcome = tree.outcome
        outcome.group_id = saved.get("group_id")
        outcome.metadata = saved.get("metadata") or {}
        outcome.reward = saved.get("reward")
        outcome.branch_rewards = {int(k): v for k, v in (saved.get("branch_rewards") or {}).items()}
        outcome.turn_rewards = {int(k): v for k, v in (saved.get("turn_rewards") or {}).items()}
        outcome.finished_at = saved.get("finished_at")
        for turn in db.execute(_SELECT_TURNS, (session_id,)):
            (_, ident, parent, keep, context, origin, sampled, logprobs, finish) = turn[:9]
            (prompt_chain, chain, count, reply, rewrite, request_key, policy_version, request_no, trace_id) = turn[9:18]
            logprob_mode, inputs, constrained = turn[18:]
            if parent is not None and not 0 <= parent < len(tree.nodes):
                raise ValueError(f"turn {ident} points at parent turn {parent}, which is not stored")
            parent_node = tree.nodes[parent] if parent is not None else None
            tree.restore(
                TurnNode(
                    id=ident,
                    parent=parent_node,
                    keep=keep,
                    context=_unints(context),
                    context_origin=Origin(origin),
                    sampled=_unints(sampled),
                    logprobs=_unfloats(logprobs),
                    finish_reason=finish,
                    depth=0 if parent_node is None else parent_node.depth + 1,
                    prompt_chain=prompt_chain,
                    chain=chain,
                    message_count=count,
                    reply=json.loads(reply),
                    rewrite=Rewrite(**json.loads(rewrite)) if rewrite else None,
                    request_key=request_key,
                    request=request_no,
                    trace_id=trace_id,
                    policy_version=policy_version,
                    logprob_mode=logprob_mode,
                    template_inputs=_inputs_of(inputs, parent_node),
                    constrained=bool(constrained),
                )
            )
    except sqlite3.Error:
        raise  # the database itself failed, not this session's rows
    except Exception as exc:
        raise StoreFailure(
            f"session {session_id!r} cannot be read from the store: {exc}", param="session_id", code="session_corrupt"
        ) from exc
    return tree


def _load(db: sqlite3.Connection, session_id: str) -> SessionTree | None:
    row = db.execute(
        "SELECT policy, created_at, outcome FROM sessions WHERE id = ? AND deleted = 0", (session_id,)
    ).fetchone()
    return None if row is None else _tree(db, session_id, *row)


def _lookup(db: sqlite3.Connection, session_id: str) -> tuple[SessionTree | None, bool]:
    row = db.execute("SELECT policy, created_at, outcome, deleted FROM sessions WHERE id = ?", (session_id,)).fetchone()
    if row is None or row[3]:
        return None, bool(row)
    return _tree(db, session_id, *row[:3]), False


def _load_many(db: sqlite3.Connection, session_ids: Sequence[str]) -> list[StoredSession]:
    loaded = []
    for session_id in session_ids:
        row = db.execute(
            "SELECT policy, created_at, outcome FROM sessions WHERE id = ? AND deleted = 0", (session_id,)
        ).fetchone()
        if row is None:
            continue  # deleted since it was listed
        try:
            loaded.append(StoredSession(session_id, row[1], _tree(db, session_id, *row)))
        except StoreFailure as exc:
            log.error("%s", exc.message)
            loaded.append(StoredSession(session_id, row[1], None, exc.message))
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


# -- threads -----------------------------------------------------------------------------------------
class Write(Generic[T]):
    """A queued write. Awaiting it returns the job's result after its commit, or raises
    `StoreFailure`. The write is queued when this object is made, and awaiting is shielded: a
    cancelled awaiter stops waiting, the write still commits. Several tasks may await one write."""

    __slots__ = ("_job",)

    def __init__(self, job: _Job) -> None:
        self._job = job

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.shield(self._job.landing()).__await__()

    def done(self) -> bool:
        return self._job.settled


class _Job:
    """One unit of work for a store thread, and the hand-over of its result to whoever waits.

    Made inside an event loop, the result lands on an asyncio future of that loop, set by one
    `call_soon_threadsafe` per committed batch (cheaper than a concurrent future wrapped per await).
    Made outside one, it lands on a concurrent future."""

    __slots__ = ("apply", "future", "loop", "settled", "waiter", "what", "write")

    def __init__(self, apply: Callable[[sqlite3.Connection], Any], what: str, write: bool = True) -> None:
        self.apply = apply
        self.what = what  # names the job in errors
        self.write = write  # False: a read, run alone outside any transaction
        self.settled = False
        self.loop = _running_loop()
        self.waiter: asyncio.Future[Any] | None = None if self.loop is None else self.loop.create_future()
        self.future: Future[Any] | None = Future() if self.loop is None else None

    def landing(self) -> asyncio.Future[Any]:
        if self.waiter is not None:
            return self.waiter
        assert self.future is not None
        return asyncio.wrap_future(self.future)


def _land(outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for waiter, value, error in outcomes:
        _set(waiter, value, error)


def _set(future: asyncio.Future[Any] | Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # a read whose reader was cancelled
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


def _settle_all(settled: list[tuple[_Job, Any, BaseException | None]]) -> None:
    """Hand results over: concurrent futures directly, each event loop's in one call."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, BaseException | None]]] = {}
    for job, value, error in settled:
        job.settled = True
        if job.future is not None:
            _set(job.future, value, error)
        elif job.loop is not None and job.waiter is not None:
            by_loop.setdefault(job.loop, []).append((job.waiter, value, error))
    for loop, outcomes in by_loop.items():
        if _running_loop() is loop:  # committed on the loop's own thread
            _land(outcomes)
            continue
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_land, outcomes)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


_STOP = object()


class _Worker(threading.Thread):
    """One thread, one connection, one queue. A writer commits the write jobs waiting together.

    A writer with nothing queued or in hand may instead have a write committed by its caller on the
    caller's thread (`commit_here`): a lone turn then costs no hand-over to this thread and back."""

    def __init__(self, name: str, connect: Callable[[], sqlite3.Connection]) -> None:
        super().__init__(name=name, daemon=True)
        self.jobs: queue.SimpleQueue[_Job | object] = queue.SimpleQueue()
        self.ready: Future[None] = Future()
        self.batches = 0
        self.committed = 0
        self.pending = 0  # jobs queued and not yet settled (under `counting`)
        self.counting = threading.Lock()
        self.using_db = threading.Lock()  # held while a thread works on the connection
        self.db: sqlite3.Connection | None = None
        self._connect = connect

    def queue(self, job: _Job) -> None:
        with self.counting:
            self.pending += 1
        self.jobs.put(job)

    def commit_here(self, job: _Job) -> bool:
        """Commit `job` on this (the caller's) thread if the worker is idle and SQLite's write lock is
        free at once; False (nothing done) otherwise, and the job is to be queued."""
        with self.counting:
            if self.pending or self.db is None or not self.using_db.acquire(blocking=False):
                return False
        db = self.db
        try:
            db.execute("PRAGMA busy_timeout = 0")
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:  # another connection writes: this thread does not wait for it
                return False
            finally:
                db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._commit(db, [job], begun=True)
            return True
        finally:
            self.using_db.release()

    def run(self) -> None:
        try:
            db = self._connect()
        except BaseException as exc:
            self.ready.set_exception(exc)
            return
        self.db = db
        self.ready.set_result(None)
        try:
            self._serve(db)
        finally:
            with self.using_db:
                self.db = None
                db.close()

    def _serve(self, db: sqlite3.Connection) -> None:
        held: _Job | None = None
        while True:
            job = held or self.jobs.get()
            held = None
            if job is _STOP:
                return
            assert isinstance(job, _Job)
            if not job.write:
                with self.using_db:
                    _settle(job, db)
                self._done(1)
                continue
            batch = [job]
            while len(batch) < MAX_BATCH:
                try:
                    following = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if following is _STOP or not (isinstance(following, _Job) and following.write):
                    held = following  # type: ignore[assignment]
                    break
                batch.append(following)
            with self.using_db:
                self._commit(db, batch)
            self._done(len(batch))

    def _done(self, jobs: int) -> None:
        with self.counting:
            self.pending -= jobs

    def _commit(self, db: sqlite3.Connection, batch: list[_Job], *, begun: bool = False) -> None:
        """Commit a batch in one transaction. If anything in it fails, nothing of it is kept and
        each job is tried again in a transaction of its own, so a failing job fails alone."""
        try:
            if not begun:
                db.execute("BEGIN IMMEDIATE")
            values = [job.apply(db) for job in batch]
            db.execute("COMMIT")
        except Exception as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            if len(batch) > 1:
                for job in batch:
                    self._commit(db, [job])
                return
            self.batches += 1
            _settle_all([(batch[0], None, _failure(batch[0], exc))])
            return
        self.batches += 1
        self.committed += len(batch)
        _settle_all([(job, value, None) for job, value in zip(batch, values, strict=True)])


def _failure(job: _Job, exc: BaseException) -> StoreFailure:
    failure = exc if isinstance(exc, StoreFailure) else StoreFailure(f"the store could not {job.what}: {exc}")
    if job.write:
        log.error("%s", failure.message)  # seen even when no one awaits the write
    return failure


def _settle(job: _Job, db: sqlite3.Connection) -> None:
    """Run a read alone and hand its result over."""
    try:
        value = job.apply(db)
    except Exception as exc:
        _settle_all([(job, None, _failure(job, exc))])
    else:
        _settle_all([(job, value, None)])


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
        self._writer = _Worker("store-writer", self._connect_writer)
        self._writer.start()
        self._writer.ready.result()
        self._reader = self._writer
        if self.path != ":memory:":
            self._reader = _Worker("store-reader", self._connect_reader)
            self._reader.start()
            self._reader.ready.result()

    def _connect_writer(self) -> sqlite3.Connection:
        # used by the writer thread, and by an event loop's thread for a write made while it is idle
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={self.synchronous}")
        db.executescript(_SCHEMA)
        for table, added in (("turns", _ADDED_TURN_COLUMNS), ("sessions", _ADDED_SESSION_COLUMNS)):
            columns = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            for column, kind in added:  # a store written by an earlier version
                if column not in columns:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
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

    def _submit(self, worker: _Worker, apply: Callable[[sqlite3.Connection], T], what: str, write: bool) -> _Job:
        job = _Job(apply, what, write)
        with self._closing:
            if not self._closed:
                if write and self._commit_inline and worker.commit_here(job):
                    return job
                worker.queue(job)
                return job
        _settle_all([(job, None, StoreFailure(f"the store could not {what}: it is closed"))])
        return job

    def _write(self, apply: Callable[[sqlite3.Connection], T], what: str) -> Write[T]:
        return Write(self._submit(self._writer, apply, what, write=True))

    async def _read(self, apply: Callable[[sqlite3.Connection], T], what: str) -> T:
        result: T = await self._submit(self._reader, apply, what, write=False).landing()
        return result

    # -- writes: queued when called; await the returned Write for the commit -----------------------
    def save_turn(self, tree: SessionTree, node: TurnNode, request_key: bytes | None = None) -> Write[bool]:
        """Queue one turn and its session row, to commit together. The row is taken from `tree`
        and `node` now, on the caller's thread. Resolves to True once committed, False if the
        session was deleted (nothing written); raises `StoreFailure` if the write failed."""
        session_id = tree.session_id
        job = _write_turn(_session_row(tree), _turn_row(session_id, node, request_key))
        return self._write(job, f"write turn {node.id} of session {session_id!r}")

    def save_session(self, tree: SessionTree) -> Write[bool]:
        """Queue a session's row (creation, rewards, finish); False if the session was deleted."""
        row = _session_row(tree)
        return self._write(lambda db: _upsert_session(db, row), f"write session {tree.session_id!r}")

    def save_session_key(self, tree: SessionTree, digest: bytes) -> Write[bool]:
        """Queue a session's row with the digest of its key (never the key itself); False if the
        session was deleted."""
        job = _write_session_key(_session_row(tree), digest)
        return self._write(job, f"write the key of session {tree.session_id!r}")

    def delete(self, session_id: str) -> Write[None]:
        """Queue the removal of a session's turns; its tombstone refuses later writes."""
        return self._write(_write_tombstone(session_id), f"delete session {session_id!r}")

    def flush(self) -> Write[None]:
        """Resolves once every write queued before it has been committed (or has failed)."""
        return self._write(lambda db: None, "flush")

    # -- reads ---------------------------------------------------------------------------------------
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
            self._writer.queue(
                _Job(lambda db: db.execute("PRAGMA wal_checkpoint(TRUNCATE)"), "checkpoint", write=False)
            )
            self._writer.jobs.put(_STOP)
            if self._reader is not self._writer:
                self._reader.jobs.put(_STOP)
        self._writer.join()
        self._reader.join()

    async def aclose(self) -> None:
        """`close` without blocking the event loop."""
        await asyncio.to_thread(self.close)

"""The store's threads: one connection each, and the writer's group commit.

`_Worker` owns one SQLite connection and one queue. As the writer, it takes every write job waiting
and commits them in one transaction (while one commit runs, the next batch gathers); a batch in which
anything fails is rolled back and its jobs retried one transaction each, so a failing job fails alone
and the others commit. A writer with nothing queued or in hand may have a write committed by its
caller on the caller's thread instead (`commit_here`). As a reader, it runs each read alone.

No waiter waits forever. A failure outside a job's own work (a PRAGMA, a BEGIN or a ROLLBACK that
raises: the connection itself failing) fails the jobs in hand with `StoreFailure` (nothing of them
was committed, so no acknowledged write is lost), and the thread serves on: on the same connection
once it is back outside any transaction, else on a new one (`reconnects`). A store that cannot get a
working connection back (a ":memory:" store, whose data lives in its one connection; a file it can
no longer open) is broken: every job queued and every later one fails at once with a clear error, as
do all of them if the thread ever ends without being stopped (`broken`).

A job's result lands where its caller waits: an asyncio future of the caller's event loop (one
`call_soon_threadsafe` per committed batch), or a concurrent future outside one. `Write` is what a
writer's caller awaits: shielded, so a cancelled awaiter never cancels the write. Jobs know nothing of
the schema: each is a function of the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from tokentape.errors import StoreFailure

__all__ = ["BUSY_TIMEOUT_MS", "MAX_BATCH", "STOP", "Job", "Worker", "Write", "settle_all"]

T = TypeVar("T")
log = logging.getLogger("tokentape.store")

MAX_BATCH = 256  # jobs per transaction: bounds how long one commit holds the first job's caller
BUSY_TIMEOUT_MS = 5000  # how long the writer thread waits for another connection's write lock


class Write(Generic[T]):
    """A queued write. Awaiting it returns the job's result after its commit, or raises
    `StoreFailure`. The write is queued when this object is made, and awaiting is shielded: a
    cancelled awaiter stops waiting, the write still commits. Several tasks may await one write."""

    __slots__ = ("_job",)

    def __init__(self, job: Job) -> None:
        self._job = job

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.shield(self._job.landing()).__await__()

    def landing(self) -> asyncio.Future[T]:
        """The future the result lands on, for a callback instead of an await (never cancel it)."""
        landing: asyncio.Future[T] = self._job.landing()
        return landing

    def done(self) -> bool:
        return self._job.settled


class Job:
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


def settle_all(settled: list[tuple[Job, Any, BaseException | None]]) -> None:
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


STOP = object()


class Worker(threading.Thread):
    """One thread, one connection, one queue. A writer commits the write jobs waiting together.

    A writer with nothing queued or in hand may instead have a write committed by its caller on the
    caller's thread (`commit_here`): a lone turn then costs no hand-over to this thread and back."""

    def __init__(self, name: str, connect: Callable[[], sqlite3.Connection], *, reconnect: bool = True) -> None:
        super().__init__(name=name, daemon=True)
        self.jobs: queue.SimpleQueue[Job | object] = queue.SimpleQueue()
        self.ready: Future[None] = Future()
        self.batches = 0
        self.committed = 0
        self.pending = 0  # jobs queued and not yet settled (under `counting`)
        self.counting = threading.Lock()
        self.using_db = threading.Lock()  # held while a thread works on the connection
        self.db: sqlite3.Connection | None = None
        self._connect = connect
        self._reconnect = reconnect  # False: the connection holds the data (":memory:"), never replaced
        self.faults = 0  # failures of the connection itself, each failing the jobs in hand
        self.reconnects = 0  # times the connection was replaced after one
        self.broken: StoreFailure | None = None  # set: every job fails with it at once
        self._suspect = False  # a caller's-thread commit left the connection in doubt: the thread checks it
        # the caller's thread never waits for SQLite's write lock (busy_timeout 0); this thread does.
        # The setting is changed only when the connection changes hands, not on every commit.
        self._impatient = False

    def queue(self, job: Job) -> None:
        with self.counting:  # under the lock: a job is either queued before the store broke, or refused
            broken = self.broken
            if broken is None:
                self.pending += 1
                self.jobs.put(job)
        if broken is not None:
            settle_all([(job, None, _refused(job, broken))])

    def commit_here(self, job: Job) -> bool:
        """Commit `job` on this (the caller's) thread if the worker is idle and SQLite's write lock is
        free at once; False (nothing done) otherwise, and the job is to be queued."""
        with self.counting:
            if (
                self.pending
                or self.db is None
                or self.broken is not None
                or self._suspect
                or not self.using_db.acquire(blocking=False)
            ):
                return False
        db = self.db
        try:
            try:
                if not self._impatient:
                    db.execute("PRAGMA busy_timeout = 0")
                    self._impatient = True
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:  # another connection writes: this thread does not wait for it
                return False
            except Exception:  # the connection failed before the job began: queued, the thread looks at it
                self._suspect = True
                return False
            try:
                self._commit(db, [job], begun=True)
            except Exception as exc:  # the connection failed (a ROLLBACK that raised): the thread looks at it
                self._fail_in_hand([job], exc)
                self._suspect = True
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
        stopped = False
        try:
            stopped = self._serve(db)
        finally:
            if not stopped:  # ended without being stopped: nothing may wait for it any more
                self._break(StoreFailure(f"the store's {self.name} thread stopped unexpectedly"))
            with self.using_db:
                if self.db is not None:
                    with contextlib.suppress(sqlite3.Error):
                        self.db.close()
                self.db = None

    def _serve(self, db: sqlite3.Connection) -> bool:
        """Serve jobs until STOP (True)."""
        held: Job | object | None = None
        while True:
            job = held or self.jobs.get()
            held = None
            if job is STOP:
                return True
            assert isinstance(job, Job)
            if self.broken is not None:
                settle_all([(job, None, _refused(job, self.broken))])
                self._done(1)
                continue
            batch = [job]
            while job.write and len(batch) < MAX_BATCH:
                try:
                    following = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if following is STOP or not (isinstance(following, Job) and following.write):
                    held = following
                    break
                batch.append(following)
            try:
                with self.using_db:
                    if self._suspect:
                        db = self._recovered(db, None)
                    self._patient(db)
                    if job.write:
                        self._commit(db, batch)
                    else:
                        _settle(job, db)
            except BaseException as exc:  # the connection itself failed: see the module's doc
                self._fail_in_hand(batch, exc)
                if not isinstance(exc, Exception):
                    raise
                with self.using_db:
                    db = self._recovered(db, exc)
            finally:
                self._done(len(batch))

    def _fail_in_hand(self, jobs: list[Job], exc: BaseException) -> None:
        """Fail the jobs of a batch that were not settled when the connection failed."""
        self.faults += 1
        log.error("the store's %s connection failed: %s: %s", self.name, type(exc).__name__, exc)
        failure = f"the store's connection failed ({type(exc).__name__}: {exc}); nothing of it was committed"
        settle_all(
            [(job, None, StoreFailure(f"the store could not {job.what}: {failure}")) for job in jobs if not job.settled]
        )

    def _recovered(self, db: sqlite3.Connection, exc: Exception | None) -> sqlite3.Connection:
        """The connection to serve on after it failed (held under `using_db`): the same one once it
        is outside any transaction and takes a statement again, else a new one. Neither: broken."""
        self._suspect = False
        try:
            if db.in_transaction:
                db.execute("ROLLBACK")
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._impatient = False
            return db
        except Exception as again:
            exc = again
        if not self._reconnect:
            self._break(StoreFailure(f"the store cannot write any more: its connection failed ({exc})"))
            return db
        with contextlib.suppress(sqlite3.Error):
            db.close()
        try:
            fresh = self._connect()
        except Exception as failed:
            self.db = None
            self._break(StoreFailure(f"the store cannot write any more: it could not reconnect ({failed})"))
            return db
        self.db, self._impatient = fresh, False
        self.reconnects += 1
        log.error("the store's %s connection was replaced after a failure", self.name)
        return fresh

    def _break(self, failure: StoreFailure) -> None:
        """From now on every job fails with `failure`: those queued now, and every later one."""
        with self.counting:
            first = self.broken is None
            self.broken = self.broken or failure
        if first:
            log.error("%s", failure.message)
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is STOP:
                self.jobs.put(STOP)  # still read by the thread, if it serves on
                return
            assert isinstance(job, Job)
            settle_all([(job, None, _refused(job, failure))])
            self._done(1)

    def _patient(self, db: sqlite3.Connection) -> None:
        """On this thread, wait up to BUSY_TIMEOUT_MS for another connection's write lock."""
        if self._impatient:
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._impatient = False

    def _done(self, jobs: int) -> None:
        with self.counting:
            self.pending -= jobs

    def _commit(self, db: sqlite3.Connection, batch: list[Job], *, begun: bool = False) -> None:
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
            settle_all([(batch[0], None, _failure(batch[0], exc))])
            return
        self.batches += 1
        self.committed += len(batch)
        settle_all([(job, value, None) for job, value in zip(batch, values, strict=True)])


def _refused(job: Job, broken: StoreFailure) -> StoreFailure:
    return StoreFailure(f"the store could not {job.what}: {broken.message}")


def _failure(job: Job, exc: BaseException) -> StoreFailure:
    failure = exc if isinstance(exc, StoreFailure) else StoreFailure(f"the store could not {job.what}: {exc}")
    if job.write:
        log.error("%s", failure.message)  # seen even when no one awaits the write
    return failure


def _settle(job: Job, db: sqlite3.Connection) -> None:
    """Run a read alone and hand its result over."""
    try:
        value = job.apply(db)
    except Exception as exc:
        settle_all([(job, None, _failure(job, exc))])
    else:
        settle_all([(job, value, None)])

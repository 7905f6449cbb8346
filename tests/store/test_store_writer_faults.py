"""The store's writer survives its own connection failing: a PRAGMA, a COMMIT and its ROLLBACK that
raise (a disk that errs, a connection in a bad state). The writes in hand fail at once with a clear
`StoreFailure` (they were not committed, so nothing acknowledged is lost), the writer serves on (on
its connection once it is whole again, else on a new one), and later writes commit. A ":memory:"
store, whose data lives in its one connection, is never reconnected: once it cannot write, every
write fails at once with a clear error, and none waits.

The faults are injected by a `sqlite3.Connection` subclass every connection of the test is made
with; `_turn` and `_stored_turns` are the store tests' own (an independent reader)."""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.store.test_store_writes import _stored_turns, _turn
from tokentape.core.session import SessionTree
from tokentape.errors import StoreFailure
from tokentape.store.sqlite import SqliteStore

BOUND = 5.0  # seconds a failed write may take to say so


class Faulty(sqlite3.Connection):
    """Raises on statements starting with an armed prefix: `faults[prefix]` times, on any connection
    (-1: always, on the connections that existed when armed)."""

    faults: ClassVar[dict[str, int]] = {}
    doomed: ClassVar[set[int]] = set()  # ids of connections whose armed statements always fail
    lock = threading.Lock()

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
        with Faulty.lock:
            for prefix, left in Faulty.faults.items():
                if sql.startswith(prefix) and (left > 0 or (left < 0 and id(self) in Faulty.doomed)):
                    if left > 0:
                        Faulty.faults[prefix] = left - 1
                    raise sqlite3.OperationalError(f"disk I/O error (injected at {prefix})")
        return super().execute(sql, *args)


@pytest.fixture(autouse=True)
def faulty_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(sqlite3, "connect", functools.partial(sqlite3.connect, factory=Faulty))
    Faulty.faults, Faulty.doomed = {}, set()
    yield
    Faulty.faults, Faulty.doomed = {}, set()


def _on_the_writer_thread(store: SqliteStore) -> None:
    """Every write goes through the writer thread, which runs `PRAGMA busy_timeout` before its next
    batch (as after a write committed on a caller's thread)."""
    store._commit_inline = False
    store._writer._impatient = True


async def _save(store: SqliteStore, tree: SessionTree, sampled: list[int]) -> bool:
    return await asyncio.wait_for(store.save_turn(tree, _turn(tree, sampled)), BOUND)


@pytest.mark.parametrize(
    ("faults", "inline"),
    [
        ({"PRAGMA busy_timeout": 1}, False),  # the writer's PRAGMA before a batch
        ({"COMMIT": 1, "ROLLBACK": 1}, False),  # a commit fails, and so does its rollback
        ({"COMMIT": 1, "ROLLBACK": 1}, True),  # the same on the caller's thread
    ],
    ids=["pragma", "rollback", "rollback-inline"],
)
async def test_a_failing_connection_fails_its_writes_in_hand_and_later_writes_commit(
    tmp_path: Path, faults: dict[str, int], inline: bool
) -> None:
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    tree = SessionTree("s")
    assert await _save(store, tree, [1])  # acknowledged before the fault
    if not inline:
        _on_the_writer_thread(store)
    Faulty.faults = dict(faults)
    with pytest.raises(StoreFailure, match=r"connection failed .*disk I/O error"):
        await _save(store, SessionTree("f"), [2])
    assert Faulty.faults == dict.fromkeys(faults, 0)  # every fault was met
    assert await _save(store, tree, [3])
    assert await _save(store, tree, [4])
    assert store._writer.is_alive() and store._writer.faults == 1
    store.close()
    assert _stored_turns(path) == {"s": [0, 1, 2]}  # the acknowledged turns, and only they


async def test_a_connection_that_stays_broken_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    tree = SessionTree("s")
    assert await _save(store, tree, [1])
    _on_the_writer_thread(store)
    assert store._writer.db is not None
    Faulty.doomed = {id(store._writer.db)}
    Faulty.faults = {"PRAGMA busy_timeout": -1, "ROLLBACK": -1}  # that connection never works again
    with pytest.raises(StoreFailure):
        await _save(store, SessionTree("f"), [2])
    assert await _save(store, tree, [3])  # on a new connection
    assert store._writer.reconnects == 1
    store.close()
    assert _stored_turns(path) == {"s": [0, 1]}


async def test_a_memory_store_that_cannot_write_refuses_every_write_at_once() -> None:
    store = SqliteStore(":memory:")
    tree = SessionTree("s")
    assert await _save(store, tree, [1])
    _on_the_writer_thread(store)
    assert store._writer.db is not None
    Faulty.doomed = {id(store._writer.db)}
    Faulty.faults = {"PRAGMA busy_timeout": -1, "ROLLBACK": -1}
    writes = [store.save_turn(tree, _turn(tree, [n])) for n in (2, 3, 4)]  # queued together
    for write in writes:
        with pytest.raises(StoreFailure):
            await asyncio.wait_for(write, BOUND)
    later = SessionTree("t")
    with pytest.raises(StoreFailure, match="cannot write any more"):
        await _save(store, later, [5])
    store.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # it ends on purpose
async def test_a_writer_thread_that_ends_fails_what_waits_and_what_comes(tmp_path: Path) -> None:
    """Should the thread end anyway (a BaseException), its waiters fail rather than wait forever."""
    store = SqliteStore(tmp_path / "store.sqlite3")
    _on_the_writer_thread(store)
    tree = SessionTree("s")

    class Stop(BaseException):
        pass

    def stop(db: sqlite3.Connection) -> None:
        raise Stop

    store._writer._patient = stop  # type: ignore[method-assign]
    first = store.save_turn(tree, _turn(tree, [1]))
    with pytest.raises(StoreFailure):
        await asyncio.wait_for(first, BOUND)
    await asyncio.to_thread(store._writer.join, BOUND)
    assert not store._writer.is_alive()
    with pytest.raises(StoreFailure, match="stopped unexpectedly"):
        await _save(store, SessionTree("t"), [2])
    store.close()

"""The store's writes: a write queued is a write committed, whatever happens to the task that asked
for it; a failed write reaches its caller; writes waiting together share one transaction; closing
commits everything queued. Real SQLite files; a second connection holding the write lock stands in
for a slow disk, so a write is provably queued behind another when its caller is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest

from tokentape.core.messages import EMPTY_CHAIN
from tokentape.core.session import NewTurn, SessionTree
from tokentape.core.tape import Origin, TurnNode
from tokentape.errors import StoreFailure
from tokentape.store.sqlite import SqliteStore


def _turn(tree: SessionTree, sampled: list[int]) -> TurnNode:
    parent = tree.nodes[-1] if tree.nodes else None
    keep = parent.end if parent is not None else 0
    turn = NewTurn(parent=parent, keep=keep, context=(1, 2, 3), context_origin=Origin.PROMPT, rewrite=None)
    return tree.attach(
        turn,
        sampled=sampled,
        logprobs=[-0.5] * len(sampled),
        finish_reason="stop",
        prompt_chain=EMPTY_CHAIN,
        prompt_length=1,
        reply={"role": "assistant", "content": "ok"},
    )


def _stored_turns(path: Path) -> dict[str, list[int]]:
    """Turn ids per session, read by a connection of our own (an independent reader)."""
    db = sqlite3.connect(path)
    found: dict[str, list[int]] = {}
    for session_id, ident in db.execute("SELECT session_id, id FROM turns ORDER BY session_id, id"):
        found.setdefault(session_id, []).append(ident)
    db.close()
    return found


@contextlib.contextmanager
def _write_lock(path: Path) -> Iterator[None]:
    """Hold SQLite's write lock from another connection: the store's writer waits behind it."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        db.execute("ROLLBACK")
        db.close()


async def _until(condition: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_cancelled_caller_never_cancels_its_own_write(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    first, second = SessionTree("first", created_at=1.0), SessionTree("second", created_at=2.0)
    node_first, node_second = _turn(first, [7]), _turn(second, [8, 9])

    async def request(tree: SessionTree, node: TurnNode) -> bool:
        return await store.save_turn(tree, node)

    with _write_lock(path):
        running = asyncio.create_task(request(first, node_first))  # taken by the writer, waits for the lock
        await asyncio.sleep(0.1)
        assert store.queued_writes == 0 and not running.done()
        abandoned = asyncio.create_task(request(second, node_second))  # queued behind it
        await _until(lambda: store.queued_writes == 1)
        abandoned.cancel()  # the client gave up while its turn was waiting to be written
        with pytest.raises(asyncio.CancelledError):
            await abandoned
    assert await running
    await store.flush()
    assert _stored_turns(path) == {"first": [0], "second": [0]}
    store.close()


async def test_a_write_awaited_by_a_cancelled_task_can_still_be_awaited_by_another(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    tree = SessionTree("shared", created_at=1.0)
    with _write_lock(path):
        write = store.save_turn(tree, _turn(tree, [5]))
        waiter = asyncio.create_task(_await(write))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not write.done()
    assert await write is True  # a retry waiting for the same turn sees it committed
    store.close()


async def _await(write: object) -> object:
    return await write  # type: ignore[misc]


async def test_a_failed_write_raises_to_its_caller_and_spares_its_batch(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON turns WHEN NEW.session_id = 'doomed' "
        "BEGIN SELECT RAISE(ABORT, 'the disk refused'); END"
    )
    db.commit()
    db.close()
    doomed, fine = SessionTree("doomed", created_at=1.0), SessionTree("fine", created_at=2.0)
    with _write_lock(path):  # both writes wait, then commit in one transaction
        writes = [store.save_turn(doomed, _turn(doomed, [1])), store.save_turn(fine, _turn(fine, [2]))]
    outcomes = await asyncio.gather(*writes, return_exceptions=True)
    assert isinstance(outcomes[0], StoreFailure) and "the disk refused" in outcomes[0].message
    assert "'doomed'" in outcomes[0].message
    assert outcomes[1] is True
    assert _stored_turns(path) == {"fine": [0]}
    store.close()


async def test_writes_waiting_together_commit_in_one_transaction(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    trees = [SessionTree(f"s{i}", created_at=float(i)) for i in range(40)]
    with _write_lock(path):
        writes = [store.save_turn(tree, _turn(tree, [i])) for i, tree in enumerate(trees)]
        await asyncio.sleep(0.05)
    assert await asyncio.gather(*writes) == [True] * 40
    assert store.writes_committed == 40
    assert store.batches <= 2  # the one taken first alone, then all the others together
    assert _stored_turns(path) == {f"s{i}": [0] for i in range(40)}
    store.close()


async def test_close_commits_every_queued_write_and_later_writes_fail(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    tree = SessionTree("late", created_at=1.0)
    writes = [store.save_turn(tree, _turn(tree, [i])) for i in range(25)]
    store.close()
    assert all(write.done() for write in writes)
    assert _stored_turns(path) == {"late": list(range(25))}
    with pytest.raises(StoreFailure, match="closed"):
        await store.save_turn(tree, _turn(tree, [99]))


async def test_reads_rebuild_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    tree = SessionTree("again", "fork", created_at=3.5)
    tree.outcome.group_id = "g"
    for sampled in ([4, 5], [6], [7, 8, 9]):
        assert await store.save_turn(tree, _turn(tree, sampled))
    store.close()
    reopened = SqliteStore(path)
    loaded = await reopened.load("again")
    assert loaded is not None and loaded.policy == "fork" and loaded.outcome.group_id == "g"
    assert [(n.id, n.parent.id if n.parent else None, n.sampled) for n in loaded.nodes] == [
        (0, None, (4, 5)),
        (1, 0, (6,)),
        (2, 1, (7, 8, 9)),
    ]
    assert await reopened.load("missing") is None and not await reopened.is_deleted("missing")
    reopened.close()


@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL"])
async def test_an_idle_writer_lets_the_caller_commit_a_lone_turn_but_never_a_disk_sync(
    tmp_path: Path, synchronous: Literal["NORMAL", "FULL"]
) -> None:
    """At NORMAL a lone turn is committed on the event loop's thread (no hand-over to the writer and
    back); at FULL, whose commit waits for the disk, always on the writer's. Seen from SQLite itself:
    the thread each statement ran on."""
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path, synchronous=synchronous)
    assert store._writer.db is not None
    ran_on: list[int] = []
    store._writer.db.set_trace_callback(lambda sql: ran_on.append(threading.get_ident()) if "INSERT" in sql else None)
    tree = SessionTree("lone", created_at=1.0)
    for i in range(3):
        assert await store.save_turn(tree, _turn(tree, [i]))
    here = threading.get_ident()
    assert ran_on and (all(t == here for t in ran_on) if synchronous == "NORMAL" else here not in ran_on)
    store.close()
    assert _stored_turns(path) == {"lone": [0, 1, 2]}


async def test_after_a_lone_turn_on_the_loop_the_writer_still_waits_for_the_write_lock(tmp_path: Path) -> None:
    """The caller's thread never waits for another connection's write lock; the writer's thread still
    does (the busy timeout goes back when the connection changes hands), so a turn that meets a held
    lock right after one committed on the loop waits for it and commits."""
    path = tmp_path / "store.sqlite3"
    store = SqliteStore(path)
    tree = SessionTree("held", created_at=1.0)
    assert await store.save_turn(tree, _turn(tree, [0]))  # committed on this thread
    with _write_lock(path):
        started = time.monotonic()
        write = store.save_turn(tree, _turn(tree, [1]))
        assert time.monotonic() - started < 0.1  # the loop did not wait for the lock
        await asyncio.sleep(0.3)
        assert not write.done()
    assert await write
    store.close()
    assert _stored_turns(path) == {"held": [0, 1]}

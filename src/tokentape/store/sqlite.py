"""The trajectory store: SQLite in WAL mode, one file. Every turn is written before its response is
acknowledged, so a restart, even after `kill -9`, reloads every acknowledged turn and the sessions
keep extending. A deleted session leaves a tombstone: no late write brings it back.

All access goes through one thread (SQLite connections are not shared across threads), so writes
are serial and never interleave.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tokentape.core.outcome import Outcome
from tokentape.core.session import SessionTree
from tokentape.core.tape import Origin, Rewrite, TurnNode

__all__ = ["SqliteStore"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    policy TEXT NOT NULL,
    created_at REAL NOT NULL,
    outcome TEXT NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0
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
CREATE INDEX IF NOT EXISTS turns_by_request ON turns (session_id, request_key);
"""


_ADDED_TURN_COLUMNS = (
    ("request_no", "INTEGER"),
    ("trace_id", "TEXT"),
    ("logprob_mode", "TEXT"),
    ("template_inputs", "TEXT"),
    ("constrained", "INTEGER NOT NULL DEFAULT 0"),
)


def _ints(values: tuple[int, ...]) -> bytes:
    return array("q", values).tobytes()


def _floats(values: tuple[float, ...]) -> bytes:
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


class SqliteStore:
    """`path` ":memory:" keeps nothing across restarts (tests, throwaway runs)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")
        self._connection: sqlite3.Connection | None = None
        self._run(self._open)

    # -- plumbing ----------------------------------------------------------------------------------
    def _open(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, isolation_level=None)
        connection.execute("PRAGMA journal_mode=WAL")
        # NORMAL survives a process kill (the WAL is in the OS); FULL would also survive power loss.
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.executescript(_SCHEMA)
        columns = {row[1] for row in connection.execute("PRAGMA table_info(turns)")}
        for column, kind in _ADDED_TURN_COLUMNS:  # a store written by an earlier version
            if column not in columns:
                connection.execute(f"ALTER TABLE turns ADD COLUMN {column} {kind}")
        self._connection = connection

    @property
    def db(self) -> sqlite3.Connection:
        assert self._connection is not None
        return self._connection

    def _run(self, fn: Any, *args: Any) -> Any:
        return self._executor.submit(fn, *args).result()

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    # -- writes --------------------------------------------------------------------------------------
    def _save_session(self, tree: SessionTree) -> bool:
        row = self.db.execute("SELECT deleted FROM sessions WHERE id = ?", (tree.session_id,)).fetchone()
        if row is not None and row[0]:
            return False
        self.db.execute(
            "INSERT INTO sessions (id, policy, created_at, outcome) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET policy = excluded.policy, outcome = excluded.outcome",
            (tree.session_id, tree.policy, tree.outcome.created_at, _outcome_json(tree.outcome)),
        )
        return True

    async def save_session(self, tree: SessionTree) -> bool:
        """Create or update a session's row; False if the session was deleted."""
        saved: bool = await self._call(self._save_session, tree)
        return saved

    def _save_turn(self, tree: SessionTree, node: TurnNode, request_key: bytes | None) -> bool:
        self.db.execute("BEGIN")
        try:
            if not self._save_session(tree):
                self.db.execute("ROLLBACK")
                return False
            self.db.execute(
                "INSERT OR REPLACE INTO turns (session_id, id, parent, keep, context, context_origin, sampled, "
                "logprobs, finish_reason, prompt_chain, chain, message_count, reply, rewrite, request_key, "
                "policy_version, request_no, trace_id, logprob_mode, template_inputs, constrained) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    tree.session_id,
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
                ),
            )
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return True

    async def save_turn(self, tree: SessionTree, node: TurnNode, request_key: bytes | None = None) -> bool:
        """Persist one turn (and its session row) in one transaction, before it is acknowledged."""
        saved: bool = await self._call(self._save_turn, tree, node, request_key)
        return saved

    def save_turn_later(self, tree: SessionTree, node: TurnNode, request_key: bytes | None = None) -> None:
        """Queue a write without waiting: for turns cut short, whose caller is already gone."""
        self._executor.submit(self._save_turn, tree, node, request_key)

    def _delete(self, session_id: str) -> None:
        self.db.execute("BEGIN")
        self.db.execute("DELETE FROM turns WHERE session_id = ?", (session_id,))
        self.db.execute(
            "INSERT INTO sessions (id, policy, created_at, outcome, deleted) VALUES (?, 'tape', 0, '{}', 1) "
            "ON CONFLICT(id) DO UPDATE SET deleted = 1",
            (session_id,),
        )
        self.db.execute("COMMIT")

    async def delete(self, session_id: str) -> None:
        await self._call(self._delete, session_id)

    # -- reads ---------------------------------------------------------------------------------------
    def _is_deleted(self, session_id: str) -> bool:
        row = self.db.execute("SELECT deleted FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return bool(row and row[0])

    def is_deleted(self, session_id: str) -> bool:
        deleted: bool = self._run(self._is_deleted, session_id)
        return deleted

    def _session_ids(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT id FROM sessions WHERE deleted = 0 ORDER BY created_at, id")]

    def session_ids(self) -> list[str]:
        ids: list[str] = self._run(self._session_ids)
        return ids

    def _load(self, session_id: str) -> SessionTree | None:
        row = self.db.execute(
            "SELECT policy, created_at, outcome FROM sessions WHERE id = ? AND deleted = 0", (session_id,)
        ).fetchone()
        if row is None:
            return None
        tree = SessionTree(session_id, row[0], created_at=row[1])
        saved = json.loads(row[2])
        outcome = tree.outcome
        outcome.group_id = saved.get("group_id")
        outcome.metadata = saved.get("metadata") or {}
        outcome.reward = saved.get("reward")
        outcome.branch_rewards = {int(k): v for k, v in (saved.get("branch_rewards") or {}).items()}
        outcome.turn_rewards = {int(k): v for k, v in (saved.get("turn_rewards") or {}).items()}
        outcome.finished_at = saved.get("finished_at")
        for turn in self.db.execute(
            "SELECT id, parent, keep, context, context_origin, sampled, logprobs, finish_reason, prompt_chain, "
            "chain, message_count, reply, rewrite, request_key, policy_version, request_no, trace_id, logprob_mode, "
            "template_inputs, constrained "
            "FROM turns WHERE session_id = ? ORDER BY id",
            (session_id,),
        ):
            (
                ident,
                parent,
                keep,
                context,
                origin,
                sampled,
                logprobs,
                finish,
                prompt_chain,
                chain,
                count,
                reply,
                rewrite,
                request_key,
                policy_version,
                request_no,
                trace_id,
                logprob_mode,
                inputs,
                constrained,
            ) = turn
            parent_node = tree.nodes[parent] if parent is not None else None
            tree.restore(
                TurnNode(
                    id=ident,
                    parent=tree.nodes[parent] if parent is not None else None,
                    keep=keep,
                    context=_unints(context),
                    context_origin=Origin(origin),
                    sampled=_unints(sampled),
                    logprobs=_unfloats(logprobs),
                    finish_reason=finish,
                    depth=0 if parent is None else tree.nodes[parent].depth + 1,
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
        return tree

    def load(self, session_id: str) -> SessionTree | None:
        tree: SessionTree | None = self._run(self._load, session_id)
        return tree

    def iter_trees(self) -> Iterator[SessionTree]:
        for session_id in self.session_ids():
            tree = self.load(session_id)
            if tree is not None:
                yield tree

    def close(self) -> None:
        def _close() -> None:
            if self._connection is not None:
                self._connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._connection.close()
                self._connection = None

        self._run(_close)
        self._executor.shutdown(wait=True)

"""The store's columns are declared once (store/schema.py): every declared field comes back as it was
written, the table on disk is the declaration, and a store written before the later columns opens,
gains them and reads its turns with their defaults."""

from __future__ import annotations

import inspect
import sqlite3
from pathlib import Path

from tests.store.test_store_writes import _turn
from tokentape.core.session import SessionTree
from tokentape.core.tape import Rewrite, TurnNode
from tokentape.store.schema import SESSIONS, TURN_COLUMNS, TURNS, Column, Table
from tokentape.store.sqlite import SqliteStore

# The tables as the first released store wrote them (before request_no ... constrained), by hand.
FIRST_SCHEMA = """
CREATE TABLE sessions (id TEXT PRIMARY KEY, policy TEXT NOT NULL, created_at REAL NOT NULL,
    outcome TEXT NOT NULL, deleted INTEGER NOT NULL DEFAULT 0);
CREATE TABLE turns (session_id TEXT NOT NULL, id INTEGER NOT NULL, parent INTEGER, keep INTEGER NOT NULL,
    context BLOB NOT NULL, context_origin INTEGER NOT NULL, sampled BLOB NOT NULL, logprobs BLOB NOT NULL,
    finish_reason TEXT NOT NULL, prompt_chain BLOB NOT NULL, chain BLOB NOT NULL, message_count INTEGER NOT NULL,
    reply TEXT NOT NULL, rewrite TEXT, request_key BLOB, policy_version TEXT, PRIMARY KEY (session_id, id));
"""


async def test_every_declared_field_comes_back_as_written(tmp_path: Path) -> None:
    tree = SessionTree("round-trip", "tape", created_at=12.5)
    tree.outcome.reward = 0.25
    tree.outcome.group_id = "g"
    first = _turn(tree, [7, 8, 9])
    second = _turn(tree, [10])
    # a value other than the default in every optional field
    second.rewrite = Rewrite(kind="assistant_edited", policy="tape", at_message=1, at_token=3, detail="changed")
    second.request = 4
    second.trace_id = "trace-1"
    second.policy_version = "v3"
    second.logprob_mode = "raw"
    second.constrained = True
    second.template_inputs = {"tools": [{"name": "t"}]}
    store = SqliteStore(tmp_path / "store.sqlite3")
    for node in (first, second):
        assert await store.save_turn(tree, node, request_key=b"key-%d" % node.id)
    loaded = await store.load("round-trip")
    store.close()
    assert loaded is not None
    assert (loaded.session_id, loaded.policy, loaded.outcome) == (tree.session_id, tree.policy, tree.outcome)
    # every argument a turn is made from is a column of its own, but what the store gives (an independent list)
    fields = set(inspect.signature(TurnNode).parameters) - {"parent", "depth", "request_key", "template_inputs"}
    declared = [c.field for c in TURN_COLUMNS if c.field is not None]
    assert sorted(declared) == sorted(fields)
    for node, back in zip((first, second), loaded.nodes, strict=True):
        for field in fields:
            assert getattr(back, field) == getattr(node, field), field
        assert back.parent is (None if node.parent is None else loaded.nodes[node.parent.id])
        assert back.request_key == b"key-%d" % node.id
        assert back.template_inputs == node.template_inputs


def test_the_tables_on_disk_are_the_declaration(tmp_path: Path) -> None:
    SqliteStore(tmp_path / "store.sqlite3").close()
    db = sqlite3.connect(tmp_path / "store.sqlite3")
    for table in (SESSIONS, TURNS):
        on_disk = [(row[1], row[2]) for row in db.execute(f"PRAGMA table_info({table.name})")]
        assert on_disk == [(c.name, c.sql.split()[0]) for c in table.columns]
    db.close()


async def test_a_store_written_before_the_later_columns_opens_and_gains_them(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    tree = SessionTree("old", "tape", created_at=1.0)
    node = _turn(tree, [5, 6])
    db = sqlite3.connect(path)
    db.executescript(FIRST_SCHEMA)
    early = {"session_id", "parent", "request_key"} | {c.name for c in TURN_COLUMNS[:16]}
    row = TURNS.row(node, {"session_id": "old", "parent": None, "request_key": None, "template_inputs": None})
    kept = [value for column, value in zip(TURN_COLUMNS, row, strict=True) if column.name in early]
    db.execute(f"INSERT INTO turns VALUES ({', '.join('?' * len(kept))})", kept)
    db.execute("INSERT INTO sessions VALUES ('old', 'tape', 1.0, '{}', 0)")
    db.commit()
    db.close()

    store = SqliteStore(path)
    loaded = await store.load("old")
    assert loaded is not None
    (back,) = loaded.nodes
    assert (back.sampled, back.context, back.reply) == (node.sampled, node.context, node.reply)
    assert (back.request, back.trace_id, back.logprob_mode, back.constrained) == (None, None, None, False)
    assert await store.save_turn(loaded, _turn(loaded, [7]))  # and takes new turns with every column
    store.close()
    db = sqlite3.connect(path)
    assert [row[1] for row in db.execute("PRAGMA table_info(turns)")] == list(TURNS.names)
    db.close()


def test_a_new_column_is_one_line_and_reaches_every_statement() -> None:
    extended = Table(TURNS.name, (*TURN_COLUMNS, Column("weight_version", "INTEGER", "policy_version")), TURNS.key)
    assert "    weight_version INTEGER,\n" in extended.ddl()
    assert extended.added_since(set(TURNS.names)) == ["ALTER TABLE turns ADD COLUMN weight_version INTEGER"]
    assert extended.insert_or_replace().count("?") == len(TURN_COLUMNS) + 1
    assert extended.select("session_id = ?").startswith(f"SELECT {', '.join(TURNS.names)}, weight_version FROM")

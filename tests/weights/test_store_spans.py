"""A turn's policy spans are stored with it and read back as they were (and a store from before
spans reads as none)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tokentape.core.session import NewTurn, SessionTree
from tokentape.core.tape import Origin
from tokentape.core.versions import PolicySpan
from tokentape.store.sqlite import SqliteStore


async def test_policy_spans_survive_the_store(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    tree = SessionTree("s", "tape")
    spans = (PolicySpan(3, 0, 2), PolicySpan(4, 2, 5, kv_version=3))
    node = tree.attach(
        NewTurn(parent=None, keep=0, context=(1, 2, 3), context_origin=Origin.PROMPT, rewrite=None),
        sampled=[10, 11, 12, 13, 14],
        logprobs=[-0.5] * 5,
        finish_reason="stop",
        prompt_chain=b"p",
        prompt_length=1,
        reply={"role": "assistant", "content": "x"},
        policy_version="3",
        policy_spans=spans,
    )
    plain = tree.attach(
        NewTurn(parent=node, keep=node.end, context=(5,), context_origin=Origin.BRIDGE, rewrite=None),
        sampled=[20],
        logprobs=[-0.1],
        finish_reason="stop",
        prompt_chain=b"q",
        prompt_length=3,
        reply={"role": "assistant", "content": "y"},
    )
    store = SqliteStore(path)
    assert await store.save_turn(tree, node, None) and await store.save_turn(tree, plain, None)
    store.close()
    reopened = SqliteStore(path)
    loaded = await reopened.load("s")
    reopened.close()
    assert loaded is not None
    assert [n.policy_spans for n in loaded.nodes] == [spans, ()]
    with sqlite3.connect(path) as db:
        (text,) = db.execute("SELECT policy_spans FROM turns WHERE id = 0").fetchone()
    assert text == '[{"version": 3, "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 5, "kv_version": 3}]'

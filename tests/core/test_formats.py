"""Every trainer format, checked field by field against the tape it came from, and round-tripped
through JSONL and Parquet files."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentape.core.formats import FORMATS, Format, check_format, format_rows, samples_of
from tokentape.core.messages import chain_of
from tokentape.core.session import NewTurn, SessionTree
from tokentape.core.tape import Origin
from tokentape.errors import InvalidRequest
from tokentape.store.datasets import read_dataset, write_dataset

tokens = st.lists(st.integers(0, 50_000), min_size=1, max_size=8)


@st.composite
def episodes(draw: st.DrawFn) -> list[SessionTree]:
    trees = []
    for s in range(draw(st.integers(1, 3))):
        tree = SessionTree(f"s{s}", created_at=100.0 + s)
        tree.outcome.group_id = draw(st.sampled_from(["g1", "g2", None]))
        node = None
        for turn in range(draw(st.integers(1, 4))):
            context = draw(tokens)
            sampled = draw(tokens)
            parent = node if turn else None
            new = NewTurn(
                parent, parent.end if parent else 0, tuple(context), Origin.BRIDGE if parent else Origin.PROMPT, None
            )
            node = tree.attach(
                new,
                sampled=sampled,
                logprobs=[-0.5 - i for i in range(len(sampled))],
                finish_reason=draw(st.sampled_from(["stop", "length"])),
                prompt_chain=chain_of([{"role": "user", "content": str(turn)}]),
                prompt_length=1,
                reply={"role": "assistant", "content": str(turn)},
            )
        tree.outcome.set_rewards(
            reward=draw(st.floats(-1, 1)),
            turn_ids={n.id for n in tree.nodes},
            branch_ids={leaf.id for leaf in tree.leaves},
        )
        if draw(st.booleans()):
            tree.outcome.set_rewards(turn_rewards={"0": 0.25}, turn_ids={n.id for n in tree.nodes}, branch_ids=set())
        trees.append(tree)
    return trees


def _truth(tree: SessionTree) -> list[dict[str, Any]]:
    return [
        {
            "tokens": b.tokens,
            "mask": b.loss_mask,
            "logprobs": b.logprobs,
            "ranges": b.action_ranges(),
            "reward": tree.outcome.branch_reward(b.leaf.id),
            "leaf": b.leaf,
        }
        for b in tree.branches()
    ]


@given(episodes())
@settings(max_examples=60, deadline=None)
def test_openrlhf_fields(trees: list[SessionTree]) -> None:
    rows = format_rows(samples_of(trees), "openrlhf")
    truth = [t for tree in trees for t in _truth(tree)]
    assert len(rows) == len(truth)
    for row, t in zip(rows, truth, strict=True):
        assert row["observation_tokens"] == t["tokens"]
        assert [tuple(r) for r in row["action_ranges"]] == t["ranges"]
        inside = {i for start, end in t["ranges"] for i in range(start, end)}
        for i, lp in enumerate(row["rollout_log_probs"]):
            assert lp == (t["logprobs"][i] if i in inside else 0.0)
        assert row["truncated"] == (t["leaf"].finish_reason == "length")
        assert row["reward"] == t["reward"]


@given(episodes())
@settings(max_examples=60, deadline=None)
def test_atropos_groups_masks_and_logprobs(trees: list[SessionTree]) -> None:
    groups = format_rows(samples_of(trees), "atropos")
    seen = 0
    for group in groups:
        members = [
            t
            for tree in trees
            for t in _truth(tree)
            if (tree.outcome.group_id or f"session:{tree.session_id}") == group["group_id"]
        ]
        assert len(group["tokens"]) == len(members) == len(group["masks"]) == len(group["scores"])
        for tokens_, masks, lps, score, t in zip(
            group["tokens"], group["masks"], group["inference_logprobs"], group["scores"], members, strict=True
        ):
            assert tokens_ == t["tokens"]
            assert masks == [tok if m else -100 for tok, m in zip(t["tokens"], t["mask"], strict=True)]
            assert lps == [1.0 if lp is None else lp for lp in t["logprobs"]]
            assert score == t["reward"]
        seen += len(members)
    assert seen == sum(len(tree.branches()) for tree in trees)


@given(episodes())
@settings(max_examples=60, deadline=None)
def test_verifiers_split_prompt_and_completion(trees: list[SessionTree]) -> None:
    rows = format_rows(samples_of(trees), "verifiers")
    for row, t in zip(rows, [t for tree in trees for t in _truth(tree)], strict=True):
        assert row["prompt_ids"] + row["completion_ids"] == t["tokens"]
        assert row["prompt_mask"] == [0] * len(row["prompt_ids"])
        assert len(row["prompt_ids"]) == t["ranges"][0][0]
        assert row["completion_mask"] == t["mask"][len(row["prompt_ids"]) :]
        assert len(row["completion_logprobs"]) == len(row["completion_ids"])
        for lp, m, truth in zip(
            row["completion_logprobs"], row["completion_mask"], t["logprobs"][len(row["prompt_ids"]) :], strict=True
        ):
            assert lp == (truth if m else 0.0)


@given(episodes())
@settings(max_examples=60, deadline=None)
def test_stepwise_one_sample_per_turn(trees: list[SessionTree]) -> None:
    rows = format_rows(samples_of(trees), "stepwise")
    expected = []
    for tree in trees:
        for t in _truth(tree):
            for start, end in t["ranges"]:
                expected.append((t["tokens"][:start], t["tokens"][start:end], t["logprobs"][start:end]))
    assert [(r["prompt_ids"], r["completion_ids"], r["completion_logprobs"]) for r in rows] == expected
    for row in rows:
        tree = next(tr for tr in trees if tr.session_id == row["session_id"])
        assert row["reward"] == tree.outcome.turn_rewards.get(
            row["turn_id"], tree.outcome.branch_reward(row["branch_id"])
        )


def _fixed_trees() -> list[SessionTree]:
    trees = []
    for s, group in enumerate(["g1", "g1", None]):
        tree = SessionTree(f"s{s}", created_at=float(s))
        tree.outcome.group_id = group
        node = None
        for turn in range(3):
            new = NewTurn(
                node, node.end if node else 0, (1, 2, 3 + turn), Origin.BRIDGE if node else Origin.PROMPT, None
            )
            node = tree.attach(
                new,
                sampled=[10 + turn, 11],
                logprobs=[-0.25, -1.5],
                finish_reason="stop",
                prompt_chain=chain_of([{"role": "user", "content": str(turn)}]),
                prompt_length=1,
                reply={"role": "assistant", "content": "r"},
            )
        tree.outcome.set_rewards(reward=0.5 * s, turn_ids={0}, branch_ids=set())
        trees.append(tree)
    trees[0].outcome.metadata = {"task": "x", "nested": {"k": [1, 2]}}
    return trees


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_datasets_round_trip(tmp_path: Path, fmt: Format, suffix: str) -> None:
    trees = _fixed_trees()
    rows = format_rows(samples_of(trees), fmt)
    back = read_dataset(write_dataset(rows, tmp_path / f"data{suffix}", fmt))
    assert len(back) == len(rows)
    for original, loaded in zip(rows, back, strict=True):
        for key, value in original.items():
            if isinstance(value, float) and math.isnan(value):
                continue
            assert loaded[key] == value, key


def test_unknown_formats_and_suffixes_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        check_format("csv")
    with pytest.raises(InvalidRequest):
        write_dataset([], tmp_path / "data.csv", "tokentape")

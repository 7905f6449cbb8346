"""One vote per rollout: every multi-row export weighs a session once however many rows it leaves as,
and the reference trainer gives each rollout one advantage in its group."""

from __future__ import annotations

import math

import httpx
import pytest

from tokentape.core.formats import FORMATS, format_rows, samples_of
from tokentape.core.rollouts import check_weighting, loss_weights, rollout_reward
from tokentape.core.session import NewTurn, SessionTree
from tokentape.core.tape import Origin
from tokentape.errors import InvalidRequest
from tokentape.train.loss import Sample, advantages


def test_each_rule_gives_a_rollout_one_vote() -> None:
    rollouts, sampled = ["a", "a", "a", "b"], [10, 20, 30, 5]
    assert loss_weights(rollouts, sampled, "rows") == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0])
    assert loss_weights(rollouts, sampled, "tokens") == pytest.approx([10 / 60, 20 / 60, 30 / 60, 1.0])
    assert loss_weights(rollouts, sampled, "none") == [1.0] * 4
    assert loss_weights(["a", "a"], [0, 0], "tokens") == [0.5, 0.5]  # nothing sampled: an even split


def test_a_rollouts_reward_is_its_rows_weighted_mean() -> None:
    rows = [{"reward": 1.0, "loss_weight": 0.25}, {"reward": 0.0, "loss_weight": 0.75}, {"reward": None}]
    assert rollout_reward(rows) == pytest.approx(0.25)
    assert rollout_reward([{"reward": None}]) is None


def _tree(session: str, branches: int, group: str = "g") -> SessionTree:
    """A session of `branches` sibling turns after one prompt (tokens: prompt 3, reply 2 each)."""
    tree = SessionTree(session)
    tree.outcome.group_id = group
    tree.outcome.reward = 1.0
    for n in range(branches):
        tree.attach(
            NewTurn(parent=None, keep=0, context=(1, 2, 3), context_origin=Origin.PROMPT, rewrite=None),
            sampled=[10 + n, 20 + n],
            logprobs=[-0.5, -0.5],
            finish_reason="stop",
            prompt_chain=f"{session}{n}".encode(),
            prompt_length=1,
            reply={"role": "assistant", "content": str(n)},
        )
    return tree


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f not in ("atropos", "packed")])
def test_every_row_format_weighs_a_session_once(fmt: str) -> None:
    rows = format_rows(samples_of([_tree("three", 3), _tree("one", 1)]), fmt)
    total: dict[str, float] = {}
    for row in rows:
        total[row["rollout_id"]] = total.get(row["rollout_id"], 0.0) + row["loss_weight"]
    assert total == pytest.approx({"three": 1.0, "one": 1.0})


def test_atropos_and_packed_rows_carry_the_weights_per_member_and_branch() -> None:
    samples = samples_of([_tree("three", 3), _tree("one", 1)])
    (group,) = format_rows(samples, "atropos")
    assert group["rollout_ids"] == ["three"] * 3 + ["one"]
    assert group["loss_weights"] == pytest.approx([1 / 3] * 3 + [1.0])
    (packed,) = format_rows(samples, "packed")
    assert len(packed["tokens"]) == 3 + 3 * 2 + 2  # the prompt once in the group, each reply once
    assert packed["branch_tokens"] == 4 * 5
    assert sum(packed["loss_coefficient"]) == pytest.approx(2 * 2)  # two rollouts x two sampled tokens
    with pytest.raises(InvalidRequest, match="weighting"):
        check_weighting("per-branch")


def _sample(session: str, reward: float, weight: float) -> Sample:
    return Sample(session, "g", [1, 2], [False, True], [0.0, -1.0], reward, [None, 0], loss_weight=weight)


def test_advantages_are_one_per_rollout_not_per_row() -> None:
    """A session of three rows and a session of one, rewards 1 and 0: two rollouts, +1 and -1
    standard deviations; per row it would be three against one."""
    rows = [_sample("a", 1.0, 1 / 3), _sample("a", 1.0, 1 / 3), _sample("a", 1.0, 1 / 3), _sample("b", 0.0, 1.0)]
    got = advantages(rows)
    assert got[:3] == pytest.approx([1.0] * 3, abs=1e-5) and got[3] == pytest.approx(-1.0, abs=1e-5)
    per_row_mean = 0.75
    assert not math.isclose(got[0], (1.0 - per_row_mean) / math.sqrt(0.1875), abs_tol=1e-3)


async def test_the_export_routes_take_the_rule_and_refuse_another(http: httpx.AsyncClient) -> None:
    bad = await http.get("/export", params={"weighting": "per-branch"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "weighting"
    assert (await http.get("/export", params={"format": "packed", "weighting": "tokens"})).status_code == 200

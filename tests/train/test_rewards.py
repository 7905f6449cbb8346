"""The reward rules of the reference loop: an episode that errored counts in its group at the error
reward, in the loss and in the plotted mean alike; advantages are over the group as sampled (a
member with nothing to train on still counts); the arithmetic reward pays nothing for a list of
numbers. Every number here is computed by hand."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from tokentape.train.loss import episode_reward, samples_from_export, trainable

EXAMPLES = Path(__file__).parents[2] / "examples"


def _arithmetic() -> Any:
    spec = importlib.util.spec_from_file_location("arithmetic_agent", EXAMPLES / "arithmetic_agent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("12", 1.0),
        (" 12. ", 1.0),
        ("5 + 7 = 12", 0.5),
        ("The answer is 12.", 0.5),
        ("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18", 0.0),  # listing numbers hits 12: nothing
        ("12 or 13", 0.0),
        ("11", 0.0),
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_the_arithmetic_reward_pays_for_the_answer_not_for_a_list_of_numbers(
    reply: str | None, expected: float
) -> None:
    assert _arithmetic().score(reply, 12, (5, 7)) == expected


def _export(session: str, group: str, reward: float | None, *, sampled: bool = True) -> dict[str, Any]:
    """One one-turn session: prompt [0:2), one sampled token [2:3) (or none: a turn of no token)."""
    end = 3 if sampled else 2
    return {
        "session_id": session,
        "summary": {"group_id": group, "reward": reward},
        "branches": [
            {
                "tokens": [1, 5, 6][:end],
                "loss_mask": [False, False, True][:end],
                "logprobs": [None, None, -0.5][:end],
                "action_ranges": [[2, end]],
                "constrained": [False],
                "policy_versions": [None],
                "logprob_modes": ["temperature_scaled_untruncated"],
                "reward": reward,
            }
        ],
    }


def test_errored_and_empty_episodes_stay_in_their_group_and_in_the_plotted_mean() -> None:
    """Group g: rewards 1.0, 0.0 (nothing to train on), None (errored, rewarded 0.5 here), and one
    that failed before its first turn (no branch, 0.5). The group's mean is 0.5 over all four."""
    exports = [
        _export("a", "g", 1.0),
        _export("b", "g", 0.0, sampled=False),
        _export("c", "g", None),
        {"session_id": "d", "summary": {"group_id": "g", "reward": None}, "branches": []},
    ]
    samples = [s for e in exports for s in samples_from_export(e, missing_reward=0.5)]
    kept, advantages = trainable(samples)
    assert [s.session_id for s in kept] == ["a", "c"]  # b and d have no token to train on
    rewards = [1.0, 0.0, 0.5, 0.5]
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)
    assert advantages == pytest.approx([(1.0 - mean) / (std + 1e-6), (0.5 - mean) / (std + 1e-6)])
    plotted = sum(episode_reward(e, 0.5) for e in exports) / len(exports)
    assert plotted == pytest.approx(mean)  # the plot counts what the loss counts


def test_the_held_out_tasks_are_fixed_and_never_drawn_for_training() -> None:
    arithmetic = _arithmetic()
    pool = {
        (a, b, c) for a in range(1, 10) for b in range(1, 10) for c in range(1, 10) if (a * 100 + b * 10 + c) % 8 == 0
    }
    held = [arithmetic.task("heldout-s0-u0000", g) for g in range(16)]
    assert held == [arithmetic.task("heldout-s2-u0020", g) for g in range(16)]  # the same set every evaluation
    assert set(held) <= pool
    trained = {
        arithmetic.task(f"train-s{seed}-{step:04d}", g) for seed in range(3) for step in range(20) for g in range(4)
    }
    assert not trained & pool and len(trained) > 100  # training draws widely, never a held-out task

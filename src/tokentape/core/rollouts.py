"""One vote per rollout: the weight each training row of a rollout carries in the loss.

A rollout is one session. A session recorded as a tree (n>1 siblings, a fork on a rewritten
history, a compacted history, sub-agents) leaves as several rows (one per branch, or one per turn
stepwise); weighted 1.0 each, it would count as many times as it has rows. `loss_weight` splits one
vote over the rollout's rows:

- `rows` (the default): 1 / (the rollout's rows), whatever their lengths;
- `tokens`: each row's share of the rollout's sampled tokens (a long branch counts more);
- `none`: 1.0 each (every row a rollout of its own, as before).

Whatever the rule, the weights of one rollout's rows add up to 1 (`none`: to its row count).
Advantages are computed once per rollout (`rollout_reward`), not per row.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from tokentape.errors import InvalidRequest

__all__ = ["WEIGHTINGS", "Weighting", "check_weighting", "loss_weights", "rollout_reward"]

Weighting = Literal["rows", "tokens", "none"]
WEIGHTINGS: tuple[Weighting, ...] = ("rows", "tokens", "none")


def check_weighting(value: str) -> Weighting:
    for known in WEIGHTINGS:
        if value == known:
            return known
    raise InvalidRequest(f"weighting must be one of {', '.join(WEIGHTINGS)}", param="weighting")


def loss_weights(rollouts: Sequence[str], sampled: Sequence[int], rule: Weighting = "rows") -> list[float]:
    """Each row's weight, given each row's rollout and its number of sampled tokens."""
    if rule == "none":
        return [1.0] * len(rollouts)
    rows: dict[str, int] = defaultdict(int)
    tokens: dict[str, int] = defaultdict(int)
    for rollout, count in zip(rollouts, sampled, strict=True):
        rows[rollout] += 1
        tokens[rollout] += count
    if rule == "rows":
        return [1.0 / rows[r] for r in rollouts]
    # a rollout with no sampled token at all: its rows share its vote evenly
    return [count / tokens[r] if tokens[r] else 1.0 / rows[r] for r, count in zip(rollouts, sampled, strict=True)]


def rollout_reward(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """A rollout's one reward from its rows (`reward`, `loss_weight`): their weighted mean (rows of
    one session usually share its reward; per-branch rewards are averaged by their weight)."""
    known = [(float(r["reward"]), float(r.get("loss_weight", 1.0))) for r in rows if r.get("reward") is not None]
    total = sum(w for _, w in known)
    return sum(v * w for v, w in known) / total if known and total > 0 else None

"""What a session is worth and where it belongs: rewards (per session, branch or turn), a group id
(GRPO-style groups of episodes from one prompt), free metadata, and whether it is finished."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokentape.errors import InvalidRequest

__all__ = ["Outcome", "check_reward"]

MAX_METADATA_BYTES = 64 * 1024  # metadata rides along in every exported sample; keep it small


def check_reward(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{param} must be a finite number", param=param)
    return float(value)


@dataclass(slots=True)
class Outcome:
    created_at: float
    group_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    branch_rewards: dict[int, float] = field(default_factory=dict)
    turn_rewards: dict[int, float] = field(default_factory=dict)
    finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    def set_rewards(
        self,
        *,
        reward: Any = None,
        branch_rewards: Mapping[Any, Any] | None = None,
        turn_rewards: Mapping[Any, Any] | None = None,
        turn_ids: set[int],
        branch_ids: set[int],
    ) -> None:
        """Validate everything first, then apply: a bad value changes nothing."""
        new_reward = None if reward is None else check_reward(reward, "reward")
        branches = _by_id(branch_rewards or {}, branch_ids, "branch_rewards")
        turns = _by_id(turn_rewards or {}, turn_ids, "turn_rewards")
        if reward is not None:
            self.reward = new_reward
        self.branch_rewards.update(branches)
        self.turn_rewards.update(turns)

    def branch_reward(self, branch_id: int) -> float | None:
        return self.branch_rewards.get(branch_id, self.reward)

    def as_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "metadata": self.metadata,
            "reward": self.reward,
            "branch_rewards": {str(k): v for k, v in self.branch_rewards.items()},
            "turn_rewards": {str(k): v for k, v in self.turn_rewards.items()},
            "finished": self.finished,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
        }


def _by_id(values: Mapping[Any, Any], known: set[int], param: str) -> dict[int, float]:
    out = {}
    for key, value in values.items():
        try:
            ident = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"{param} keys must be turn or branch ids", param=param) from None
        if ident not in known:
            raise InvalidRequest(f"{param}: no id {ident} in this session", param=param)
        out[ident] = check_reward(value, f"{param}.{key}")
    return out

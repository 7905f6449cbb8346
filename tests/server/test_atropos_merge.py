"""A group whose sessions sit in several gateways' shards arrives as one Atropos row per shard and
leaves as one row: every per-member field joined in the same order, so a member's tokens, masks,
scores, weights and versions stay together."""

from __future__ import annotations

from typing import Any

from tokentape.ray.routing import merge_atropos_rows


def _row(group: str, members: list[str]) -> dict[str, Any]:
    return {
        "schema_version": 3,
        "group_id": group,
        "session_ids": members,
        "branch_ids": [1 for _ in members],
        "tokens": [[len(m), 7] for m in members],
        "masks": [[-100, 7] for _ in members],
        "inference_logprobs": [[1.0, -0.5] for _ in members],
        "scores": [float(len(m)) for m in members],
        "rollout_ids": members,
        "loss_weights": [0.5 for _ in members],
        "policy_versions": [[0] for _ in members],
        "versions": [[0, 0] for _ in members],
        "param_version_start": [0 for _ in members],
        "param_version_end": [1 for _ in members],
        "policy_spans": [[[0, 2, 0]] for _ in members],
        "constrained": [[False] for _ in members],
    }


def test_every_per_member_field_stays_aligned_across_shards() -> None:
    shards = [_row("g", ["a", "bb"]), _row("g", ["ccc"]), _row("h", ["d"])]
    merged = {row["group_id"]: row for row in merge_atropos_rows(shards)}
    g = merged["g"]
    assert g["session_ids"] == ["a", "bb", "ccc"]
    for name, value in shards[0].items():
        if isinstance(value, list):
            assert g[name] == value + shards[1][name], name  # each field, in the members' order
    assert g["schema_version"] == 3
    assert merged["h"] == shards[2]

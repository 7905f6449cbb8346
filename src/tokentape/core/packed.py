"""Packed rows: a tree of branches as one row, every shared token once.

Branches (of one session, or of a group's sessions that share a prompt) are merged into a trie: a
token joins an existing one when it has the same parent and the same token, loss mask, logprob and
version (so two branches share exactly the positions they recorded alike); a sampled token is shared
only within its rollout (two sessions that sampled the same first token keep one each, so every
sampled token has one rollout and one advantage). The row lists tokens
parents-first, branch by branch, with:

- `parents`: each token's parent index (-1 for a root); a token attends to exactly its ancestors and
  itself, so the attention mask is built from this alone (`attention_mask`);
- `position_ids`: each token's depth on its own path (what its position is in its branch);
- `loss_mask`, `logprobs` (null where not sampled), `versions` (-1 where not sampled);
- `loss_coefficient`: per token, the sum of the `loss_weight`s of the branches that hold it. For a
  token-level policy-gradient loss with one advantage per rollout, sum_t coef_t * A * f(t) over the
  packed row equals sum_b w_b * A * sum_{t in b} f(t) over the branches (a shared token counts once
  per branch in the per-branch loss, as its coefficient says);
- per branch: `branch_ends` (the index of its last token; the branch is that token's ancestors),
  `branch_ids`, `rollout_ids`, `rewards`, `loss_weights`;
- images: each image once (`images`, `image_grid_thw`), its runs in packed positions (`image_runs`).

A token's logprob is predicted at its parent's position, not at the index before it (a packed row
is not one causal sequence): `parents` gives that position for every token (-1 for a root, which
is never trained on).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ancestors", "attention_mask", "pack_branches"]

_Key = tuple[int, int, int, float | None, int, str | None]


def pack_branches(branches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One packed row from exported branches (the tokentape format's per-token lists, each with
    `branch_id`, `rollout_id`, `reward` and `loss_weight`; `versions` optional)."""
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    mask: list[int] = []
    logprobs: list[float | None] = []
    versions: list[int] = []
    coefficient: list[float] = []
    children: dict[_Key, int] = {}
    ends: list[int] = []
    images: dict[tuple[str, int], dict[str, Any]] = {}
    image_list: list[str] = []
    grids: list[list[int]] = []
    for branch in branches:
        weight = float(branch.get("loss_weight", 1.0))
        rollout = str(branch.get("rollout_id"))
        own_versions = branch.get("versions") or [-1] * len(branch["tokens"])
        at = -1
        where: list[int] = []
        for token, m, lp, version in zip(
            branch["tokens"], branch["loss_mask"], branch["logprobs"], own_versions, strict=True
        ):
            key = (at, int(token), int(m), lp, int(version), rollout if m else None)
            index = children.get(key)
            if index is None:
                index = len(tokens)
                children[key] = index
                tokens.append(int(token))
                parents.append(at)
                depth.append(0 if at < 0 else depth[at] + 1)
                mask.append(int(m))
                logprobs.append(lp)
                versions.append(int(version))
                coefficient.append(0.0)
            if m:
                coefficient[index] += weight
            where.append(index)
            at = index
        ends.append(at)
        for n, run in enumerate(branch.get("image_runs") or []):
            start = where[run["start"]]
            if (run["digest"], start) not in images:
                images[(run["digest"], start)] = {
                    "digest": run["digest"],
                    "start": start,
                    "end": where[run["end"] - 1] + 1,
                }
                image_list.append(branch["images"][n])
                grids.append(list(branch["image_grid_thw"][n]))
    row: dict[str, Any] = {
        "tokens": tokens,
        "parents": parents,
        "position_ids": depth,
        "loss_mask": mask,
        "logprobs": logprobs,
        "versions": versions,
        "loss_coefficient": coefficient,
        "branch_ends": ends,
        "branch_ids": [b.get("branch_id") for b in branches],
        "rollout_ids": [b.get("rollout_id") for b in branches],
        "rewards": [b.get("reward") for b in branches],
        "loss_weights": [float(b.get("loss_weight", 1.0)) for b in branches],
        "branch_tokens": sum(len(b["tokens"]) for b in branches),  # what the per-branch rows hold
        "param_version_start": min((v for v in versions if v >= 0), default=None),
        "param_version_end": max((v for v in versions if v >= 0), default=None),
    }
    if images:
        row.update(images=image_list, image_grid_thw=grids, image_runs=list(images.values()))
    return row


def ancestors(parents: Sequence[int]) -> list[set[int]]:
    """Each token's ancestors and itself (for checks and small rows; `attention_mask` for tensors)."""
    out: list[set[int]] = []
    for i, p in enumerate(parents):
        out.append({*(out[p] if p >= 0 else ()), i})
    return out


def attention_mask(parents: Sequence[int]) -> Any:
    """The [N, N] boolean mask of a packed row (True: token i may attend to token j): exactly its
    ancestors and itself. Parents come before children, so one pass down the rows builds it."""
    import torch

    n = len(parents)
    allowed = torch.zeros((n, n), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            allowed[i] = allowed[p]
        allowed[i, i] = True
    return allowed

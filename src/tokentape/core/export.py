"""The session export: every branch as per-token lists of equal length, exact to the token.

Logprobs are the engine's logprobs of sampled tokens; what they are is recorded per turn, as the engine
reported it for that turn's sampling parameters (`logprob_modes`, one per turn):
  temperature_scaled_untruncated  log_softmax(logits / temperature): what a trainer recomputes for its
                                  importance ratio (the embedded engine, at any temperature > 0)
  temperature_scaled_truncated    after the top-k/top-p/min-p cut too, renormalized
  raw                             log_softmax(logits), temperature ignored (greedy turns; vLLM's default)
None for a turn recorded before modes were. Prompt and bridge positions carry null, never a number.

Weights versions (`core.versions.version_fields`): `versions` per token (-1 off the sampled tokens),
`param_version_start` / `param_version_end` over the branch, `policy_spans` per turn.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

from tokentape.core.images import DecodedImage
from tokentape.core.session import SessionTree
from tokentape.core.tape import BranchView
from tokentape.core.versions import version_fields

__all__ = [
    "EXPORT_SCHEMA_VERSION",
    "data_url",
    "export_branch",
    "export_session",
    "common_logprob_mode",
    "image_fields",
    "verl_multi_modal",
]

EXPORT_SCHEMA_VERSION = 2  # 2: the per-token `turns` (a position, not an id) is named `turn_index`


def common_logprob_mode(modes: Iterable[str | None]) -> str | None:
    """The mode every recorded turn shares, "mixed" when they differ, None when none was recorded."""
    known = {mode for mode in modes if mode is not None}
    return known.pop() if len(known) == 1 else ("mixed" if known else None)


def image_fields(branch: BranchView, images: Mapping[str, DecodedImage]) -> dict[str, Any]:
    """What a trainer's processor needs of a branch's images (nothing for a branch without any):
    `images`, one per occurrence in token order, the image as a data URL (the same image shown twice
    is two entries, as the prompt holds two runs); `image_grid_thw`, the processor's grid of each;
    `image_runs`, each run's [start, end) in `tokens` with its image's digest. Every run is prompt or
    bridge, so the loss mask is 0 all over it. `images`: the images' bytes by digest."""
    if not branch.images:
        return {}
    return {
        "images": [data_url(images[run.digest]) for run in branch.images],
        "image_grid_thw": [list(run.grid) for run in branch.images],
        "image_runs": [{"digest": run.digest, "start": run.start, "end": run.end} for run in branch.images],
    }


def verl_multi_modal(row: Mapping[str, Any]) -> dict[str, Any]:
    """An exported row's images in verl's terms (`AgentLoopOutput.multi_modal_data` and the processor
    outputs its trainer reads); empty for a row without images."""
    if not row.get("images"):
        return {}
    return {
        "multi_modal_data": {"image": list(row["images"])},
        "multi_modal_inputs": {"image_grid_thw": [list(g) for g in row["image_grid_thw"]]},
    }


def data_url(image: DecodedImage) -> str:
    return f"data:{image.media_type};base64,{base64.b64encode(image.data).decode()}"


def export_branch(branch: BranchView, images: Mapping[str, DecodedImage] | None = None) -> dict[str, Any]:
    leaf = branch.leaf
    return {
        "branch_id": leaf.id,
        "tokens": branch.tokens,
        "loss_mask": branch.loss_mask,
        "logprobs": branch.logprobs,
        "origins": [origin.label for origin in branch.origins],
        "turn_index": branch.turns,  # per token: its turn's index in this branch's per-turn lists
        "action_ranges": [list(r) for r in branch.action_ranges()],
        "finish_reasons": [node.finish_reason for node in branch.nodes],
        "truncated": leaf.finish_reason == "length",
        "rewrites": [node.rewrite.as_dict() for node in branch.nodes if node.rewrite is not None],
        "turn_ids": [node.id for node in branch.nodes],
        "policy_versions": [node.policy_version for node in branch.nodes],
        "trace_ids": [node.trace_id for node in branch.nodes],  # a second session name the client sent
        "logprob_modes": [node.logprob_mode for node in branch.nodes],
        # per turn: sampled under a constraint (its logprobs are not the free policy's)
        "constrained": [node.constrained for node in branch.nodes],
        # per turn: what its request sent that the model was not shown (hosted tools left out, ...)
        "notes": [list((node.template_inputs or {}).get("notes") or ()) for node in branch.nodes],
        # per turn: temperature, top_p, top_k, min_p it was sampled with (None: not recorded)
        "sampling": [None if node.sampling is None else dict(node.sampling) for node in branch.nodes],
        **version_fields(branch),
        **image_fields(branch, images or {}),
    }


def export_session(tree: SessionTree, images: Mapping[str, DecodedImage] | None = None) -> dict[str, Any]:
    """The native export of one session. Each branch's `loss_weight` is its share of the session's
    one vote (1 / branches: `core.rollouts`, rule `rows`). `images`: the bytes of the images the
    session shows, by digest (the tree holds their facts only; `ImageLibrary.read_all` reads them)."""
    branches = tree.branches()
    return {
        "schema_version": EXPORT_SCHEMA_VERSION,
        "session_id": tree.session_id,
        "logprob_mode": common_logprob_mode(node.logprob_mode for node in tree.nodes),
        "summary": tree.summary(),
        "branches": [
            {
                **export_branch(branch, images),
                "reward": tree.outcome.branch_reward(branch.leaf.id),
                "loss_weight": 1.0 / len(branches),
            }
            for branch in branches
        ],
    }

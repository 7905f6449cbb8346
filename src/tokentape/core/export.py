"""The session export: every branch as per-token lists of equal length, exact to the token.

Logprobs are the values the engine reported for the tokens it sampled; prompt and bridge positions
carry null, never a placeholder number. `logprob_mode` names the embedded engine's convention (logits
divided by the sampling temperature, before top-p/top-k/min-p truncation: what a trainer recomputes
for its importance ratio) and is stamped on every export: turns sampled by a remote engine carry
whatever that engine reports (vLLM: its `--logprobs-mode`), which this field does not tell apart.
"""

from __future__ import annotations

from typing import Any

from tokentape.core.session import SessionTree
from tokentape.core.tape import BranchView

__all__ = ["EXPORT_SCHEMA_VERSION", "LOGPROB_MODE", "export_branch", "export_session"]

EXPORT_SCHEMA_VERSION = 1
LOGPROB_MODE = "temperature_scaled_untruncated"


def export_branch(branch: BranchView) -> dict[str, Any]:
    leaf = branch.leaf
    return {
        "branch_id": leaf.id,
        "tokens": branch.tokens,
        "loss_mask": branch.loss_mask,
        "logprobs": branch.logprobs,
        "origins": [origin.label for origin in branch.origins],
        "turns": branch.turns,
        "action_ranges": [list(r) for r in branch.action_ranges()],
        "finish_reasons": [node.finish_reason for node in branch.nodes],
        "truncated": leaf.finish_reason == "length",
        "rewrites": [node.rewrite.as_dict() for node in branch.nodes if node.rewrite is not None],
        "turn_ids": [node.id for node in branch.nodes],
        "policy_versions": [node.policy_version for node in branch.nodes],
        "trace_ids": [node.trace_id for node in branch.nodes],  # a second session name the client sent
    }


def export_session(tree: SessionTree) -> dict[str, Any]:
    return {
        "schema_version": EXPORT_SCHEMA_VERSION,
        "session_id": tree.session_id,
        "logprob_mode": LOGPROB_MODE,
        "summary": tree.summary(),
        "branches": [
            {**export_branch(branch), "reward": tree.outcome.branch_reward(branch.leaf.id)}
            for branch in tree.branches()
        ],
    }

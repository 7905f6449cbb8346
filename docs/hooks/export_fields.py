"""What every exported field is: its type, what one entry of a list stands for, and what it means.

The docs hook (`reference.py`) writes the export reference from a real export and looks every field
it finds up here: a field the export holds but this table does not name, a value that does not have
the declared type, a list of the wrong length, or an entry for a field the export no longer holds,
fails the build. The export is built in `tokentape.core.export` (the native session export) and
`tokentape.core.formats` (the trainer formats, whose rows all start with `Sample.head()`).

Each entry is `(type, per, meaning)`. `type` is written `int`, `float`, `str`, `bool`, `object`,
`list[T]`, and `T | null`. `per` says what one entry of a list stands for, and is checked against the
export where it is one of `PER_CHECKED`: `token` (as long as the row's tokens), `turn` (one per turn
of the branch), `member` (one per member of an Atropos group); other words (`image`, `sampled token`)
are shown, not checked.
"""

from __future__ import annotations

Field = tuple[str, str, str]

PER_CHECKED = ("token", "turn", "member")

# -- the native export (`GET /sessions/{id}/export`) ---------------------------------------------------

SESSION: dict[str, Field] = {
    "schema_version": ("int", "", "Version of this layout; it changes when a field is renamed or changes meaning."),
    "session_id": ("str", "", "The session's id."),
    "logprob_mode": (
        "str | null",
        "",
        "What the logprobs are, shared by every turn: `temperature_scaled_untruncated`, "
        "`temperature_scaled_truncated` or `raw`; `mixed` when turns differ; null when none was recorded.",
    ),
    "summary": ("object", "", "The session's summary: the fields below."),
    "branches": ("list[object]", "branch", "Every root-to-leaf path of the session tree, one training sample each."),
}

SUMMARY: dict[str, Field] = {
    "session_id": ("str", "", "The session's id."),
    "policy": (
        "str",
        "",
        "Its rewrite policy: what happens when the agent edits history (`tape`, `fork` or `strict`).",
    ),
    "turns": ("int", "", "Generations recorded in the whole tree."),
    "branches": ("int", "", "Root-to-leaf paths (leaves) of the tree."),
    "tokens": ("int", "", "Tokens on the tape over the whole tree (prompt, sampled and bridge)."),
    "sampled_tokens": ("int", "", "Tokens the engine sampled over the whole tree."),
    "rewrites": ("int", "", "Times the agent sent a history that differs from what was recorded."),
    "group_id": ("str | null", "", "The group the session was created in (GRPO's group); null if none."),
    "metadata": ("object", "", "What the trainer attached at creation or finish."),
    "reward": ("float | null", "", "The episode's reward; null until one is set."),
    "branch_rewards": ("object", "", "Rewards set per branch: branch id (as text) -> reward."),
    "turn_rewards": ("object", "", "Rewards set per turn: turn id (as text) -> reward."),
    "finished": ("bool", "", "Whether `finish` was called: no further turns are taken."),
    "created_at": ("float", "", "Creation time, Unix seconds."),
    "finished_at": ("float | null", "", "Finish time, Unix seconds; null while open."),
}

BRANCH: dict[str, Field] = {
    "branch_id": ("int", "", "The id of the branch's last turn (its leaf)."),
    "tokens": ("list[int]", "token", "The token IDs of the branch, exactly as the model saw and sampled them."),
    "loss_mask": ("list[int]", "token", "1 on tokens the engine sampled (train on these), 0 elsewhere."),
    "logprobs": (
        "list[float | null]",
        "token",
        "The engine's logprob of each sampled token (see `logprob_modes`); null on prompt and bridge tokens.",
    ),
    "origins": (
        "list[str]",
        "token",
        "Where each token came from: `prompt` (rendered prompt), `sampled` (the engine), `bridge` "
        "(rendered after a reply: turn close, new messages, generation prompt).",
    ),
    "turn_index": (
        "list[int]",
        "token",
        "The index of each token's turn in this branch's per-turn lists (`turn_ids`, `action_ranges`, ...).",
    ),
    "action_ranges": ("list[list[int]]", "turn", "Each turn's sampled tokens as `[start, end)` in `tokens`."),
    "finish_reasons": ("list[str]", "turn", "Why each turn stopped: `stop`, `length`, `tool_calls` or `abort`."),
    "truncated": ("bool", "", "Whether the last turn stopped at its token limit (`length`)."),
    "rewrites": (
        "list[object]",
        "rewrite",
        "The rewrites on this branch: `kind`, `policy`, `at_message`, `at_token`, `detail`.",
    ),
    "turn_ids": ("list[int]", "turn", "Each turn's id in the session (the ids rewards and the viewer use)."),
    "policy_versions": (
        "list[str | null]",
        "turn",
        "The policy label each turn was sampled under (`POST /admin/resume`, weight updates); null if none was set.",
    ),
    "trace_ids": ("list[str | null]", "turn", "A second session name the client sent with each turn, if any."),
    "logprob_modes": (
        "list[str | null]",
        "turn",
        "What each turn's logprobs are (see `logprob_mode`); null for a turn recorded before modes were.",
    ),
    "constrained": (
        "list[bool]",
        "turn",
        "Whether each turn was sampled under a constraint (a required or named tool call, a JSON "
        "response format): its logprobs are then not the free policy's.",
    ),
    "notes": (
        "list[list[str]]",
        "turn",
        "Per turn, what its request sent that the model was not shown, in words (e.g. the hosted tools a "
        "Responses request offered, which no engine here runs, left out of the tool list); empty if nothing.",
    ),
    "sampling": (
        "list[object | null]",
        "turn",
        "The temperature, top_p, top_k and min_p each turn was sampled with; null if not recorded.",
    ),
    "versions": (
        "list[int]",
        "token",
        "The weights version that sampled each token; -1 on prompt and bridge tokens or when not known "
        "(AReaL's `versions`).",
    ),
    "param_version_start": ("int | null", "", "The oldest weights version over the sampled tokens (verl's name)."),
    "param_version_end": ("int | null", "", "The newest weights version over the sampled tokens (verl's name)."),
    "policy_spans": (
        "list[list[object]]",
        "turn",
        "Per turn, its spans of one weights version: `version`, `start`, `end` (offsets into that turn's "
        "sampled tokens), and `kv_version` when the KV cache was older.",
    ),
    "reward": ("float | null", "", "The branch's reward: its own if one was set, else the episode's."),
    "loss_weight": (
        "float",
        "",
        "The branch's share of its session's one vote in the loss: 1 / the session's branches, so a "
        "session that splits into several rows counts once.",
    ),
}

# Fields present only in some exports: shown on the page from this table, not read off the sample.
OPTIONAL: dict[str, Field] = {
    "images": (
        "list[str]",
        "image",
        "Only for a branch with images: each image occurrence in token order, as a `data:` URL.",
    ),
    "image_grid_thw": ("list[list[int]]", "image", "Only with images: the processor's (t, h, w) grid of each image."),
    "image_runs": (
        "list[object]",
        "image",
        "Only with images: each image's run of tokens, `start`, `end` in `tokens` and the image's `digest`.",
    ),
    "token_texts": ("list[str]", "token", "Native export with `texts=true` only: the text of each token."),
    "masked_by_lag": (
        "int",
        "",
        "Only with `max_lag` and `lag_mode=mask` (formats tokentape, verifiers): tokens taken out of the "
        "loss for being sampled by weights too old.",
    ),
}

# -- the trainer formats (`?format=...`) --------------------------------------------------------------

# Every row but Atropos's starts with these (`core.formats.Sample.head`).
HEAD: dict[str, Field] = {
    "schema_version": SESSION["schema_version"],
    "session_id": SESSION["session_id"],
    "rollout_id": ("str", "", "The rollout the row belongs to: its session. Advantages are computed once per rollout."),
    "loss_weight": (
        "float",
        "",
        "The row's share of its rollout's one vote (`weighting`: `rows` 1 / the rollout's rows, the default; "
        "`tokens` its share of the rollout's sampled tokens; `none` 1.0). A rollout's rows add up to 1.",
    ),
    "branch_id": BRANCH["branch_id"],
    "group_id": SUMMARY["group_id"],
    "reward": BRANCH["reward"],
    "finished": SUMMARY["finished"],
    "metadata": SUMMARY["metadata"],
    "policy_versions": BRANCH["policy_versions"],
    "constrained": BRANCH["constrained"],
    "versions": BRANCH["versions"],
    "param_version_start": BRANCH["param_version_start"],
    "param_version_end": BRANCH["param_version_end"],
    "policy_spans": BRANCH["policy_spans"],
}

FORMATS: dict[str, dict[str, Field]] = {
    "tokentape": {
        **{k: v for k, v in BRANCH.items() if k != "reward"},
        "logprob_mode": SESSION["logprob_mode"],
        "turn_rewards": ("list[float | null]", "turn", "The reward set on each turn, if any."),
    },
    "openrlhf": {
        "observation_tokens": ("list[int]", "token", "The branch's tokens (OpenRLHF's name)."),
        "action_ranges": BRANCH["action_ranges"],
        "rollout_log_probs": (
            "list[float]",
            "token",
            "The sampled tokens' logprobs, 0.0 outside the action ranges (as OpenRLHF's own executor writes).",
        ),
        "truncated": BRANCH["truncated"],
    },
    "atropos": {
        "schema_version": SESSION["schema_version"],
        "group_id": ("str", "", "The group; a session without one is a group of its own, `session:<id>`."),
        "session_ids": ("list[str]", "member", "Each member's session."),
        "branch_ids": ("list[int]", "member", "Each member's branch."),
        "tokens": ("list[list[int]]", "member", "Each member's token IDs."),
        "masks": (
            "list[list[int]]",
            "member",
            "Each member's tokens again where the model sampled them, -100 elsewhere (Atropos's mask).",
        ),
        "inference_logprobs": (
            "list[list[float]]",
            "member",
            "Each member's per-token logprobs, 1.0 where masked (Atropos's convention).",
        ),
        "scores": ("list[float | null]", "member", "Each member's reward."),
        "rollout_ids": ("list[str]", "member", "Each member's rollout (its session)."),
        "loss_weights": ("list[float]", "member", "Each member's share of its rollout's one vote (`loss_weight`)."),
        "policy_versions": ("list[list[str | null]]", "member", "Each member's per-turn policy labels."),
        "versions": ("list[list[int]]", "member", "Each member's per-token weights versions (-1: not sampled)."),
        "param_version_start": ("list[int | null]", "member", "Each member's oldest weights version."),
        "param_version_end": ("list[int | null]", "member", "Each member's newest weights version."),
        "policy_spans": ("list[list[list[object]]]", "member", "Each member's per-turn version spans."),
        "constrained": ("list[list[bool]]", "member", "Each member's per-turn constrained flags."),
    },
    "verifiers": {
        "prompt_ids": ("list[int]", "prompt token", "The tokens before the first sampled token."),
        "prompt_mask": ("list[int]", "prompt token", "All 0: the prompt is not trained on."),
        "completion_ids": (
            "list[int]",
            "completion token",
            "Everything after the prompt: sampled tokens, and the tool results and user turns between them.",
        ),
        "completion_mask": (
            "list[int]",
            "completion token",
            "1 on sampled tokens, 0 on the bridges between them (tool results, user turns).",
        ),
        "completion_logprobs": (
            "list[float]",
            "completion token",
            "The sampled tokens' logprobs, 0.0 where the mask is 0.",
        ),
        "is_truncated": BRANCH["truncated"],
    },
    "stepwise": {
        "reward": ("float | null", "", "This turn's reward if one was set, else the branch's."),
        "constrained": ("bool", "", "Whether this turn was sampled under a constraint."),
        "step": ("int", "", "The turn's position on the branch, from 0."),
        "turn_id": ("int", "", "The turn's id in the session."),
        "policy_version": ("str | null", "", "The policy label this turn was sampled under."),
        "completion_versions": (
            "list[int]",
            "sampled token",
            "The weights version of each token of `completion_ids` (-1: not known).",
        ),
        "prompt_ids": ("list[int]", "prompt token", "Everything the model saw before this turn."),
        "completion_ids": ("list[int]", "sampled token", "What it sampled in this turn."),
        "completion_logprobs": ("list[float]", "sampled token", "The logprob of each sampled token."),
        "finish_reason": ("str", "", "Why this turn stopped: `stop`, `length`, `tool_calls` or `abort`."),
    },
    "packed": {
        "schema_version": SESSION["schema_version"],
        "group_id": ("str", "", "The group packed in this row; a session without one is its own, `session:<id>`."),
        "session_ids": ("list[str]", "session", "The sessions packed in this row."),
        "tokens": ("list[int]", "packed token", "Every token of every branch once, parents before children."),
        "parents": (
            "list[int]",
            "packed token",
            "Each token's parent index (-1: a root). A token attends to its ancestors and itself only, and "
            "is predicted at its parent's position.",
        ),
        "position_ids": ("list[int]", "packed token", "Each token's position on its own path (its depth)."),
        "loss_mask": ("list[int]", "packed token", BRANCH["loss_mask"][2]),
        "logprobs": ("list[float | null]", "packed token", BRANCH["logprobs"][2]),
        "versions": ("list[int]", "packed token", BRANCH["versions"][2]),
        "loss_coefficient": (
            "list[float]",
            "packed token",
            "The sum of the `loss_weight`s of the branches holding the token (0 off the mask): with one advantage "
            "per rollout, the packed token-level loss equals the per-branch one.",
        ),
        "branch_ends": ("list[int]", "branch", "Each branch's last token: the branch is that token and its ancestors."),
        "branch_ids": ("list[int]", "branch", "Each branch's id in its session."),
        "rollout_ids": ("list[str]", "branch", "Each branch's rollout (its session)."),
        "rewards": ("list[float | null]", "branch", "Each branch's reward."),
        "loss_weights": ("list[float]", "branch", "Each branch's share of its rollout's one vote."),
        "branch_tokens": ("int", "", "Tokens the per-branch rows would hold: what packing saved, against `tokens`."),
        "param_version_start": ("int | null", "", "The oldest weights version of any sampled token in the row."),
        "param_version_end": ("int | null", "", "The newest weights version of any sampled token in the row."),
    },
}


def field_of(fmt: str, name: str) -> Field | None:
    """A trainer format's field: its own entry, else the shared head's (every format but Atropos);
    None for a field, or a format, this table does not describe."""
    own = FORMATS.get(fmt, {})
    if name in own:
        return own[name]
    return None if fmt in ("atropos", "packed") else HEAD.get(name)

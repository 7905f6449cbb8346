"""Training samples in the shapes trainers read, all from the same tape.

One branch is one sample (`merged`); `stepwise` makes one sample per turn. Per format:

- tokentape: the native export (tokens, loss_mask, logprobs with null off-policy positions, origins,
  turn_index, action_ranges, finish_reasons, rewrites) plus reward, group and metadata.
- openrlhf: `observation_tokens`, `action_ranges` ([start, end) of each sampled span),
  `rollout_log_probs` (aligned with the tokens; 0.0 outside the action ranges, as OpenRLHF's own
  executor writes), `truncated`, `reward`.
- atropos: groups (`group_id`) of `tokens`, `masks` (the token ID where the model sampled it, -100
  elsewhere), `inference_logprobs` (aligned; 1.0 where masked, Atropos's convention), `scores`.
- verifiers: `prompt_ids`/`prompt_mask` (the first prompt, mask 0), `completion_ids`,
  `completion_mask` (1 on sampled tokens, 0 on bridges: tool results and user turns are in the
  completion but not trained), `completion_logprobs` (0.0 where the mask is 0).
- stepwise: per turn, `prompt_ids` = everything the model saw, `completion_ids` = what it sampled,
  with that turn's reward if one was set, else the branch's, and `completion_versions`.

Every format carries the weights versions (`core.versions.version_fields`): `versions` per token
(AReaL; -1 where nothing was sampled), `param_version_start` / `param_version_end` (verl) and
`policy_spans` per turn; OpenRLHF and Atropos rows carry them as extra fields (Atropos: per member).

Bridge tokens have no place of their own in openrlhf/atropos/verifiers: they sit in the observation,
masked out. Rewrites are listed in the tokentape format only; under the `fork` policy a rewrite is a
separate branch and so a separate sample in every format.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from tokentape.core.export import EXPORT_SCHEMA_VERSION, common_logprob_mode, export_branch, image_fields
from tokentape.core.images import DecodedImage
from tokentape.core.packed import pack_branches
from tokentape.core.rollouts import Weighting, loss_weights
from tokentape.core.session import SessionTree
from tokentape.core.staleness import LagWindow
from tokentape.core.tape import BranchView
from tokentape.core.versions import node_versions, version_fields
from tokentape.errors import InvalidRequest

__all__ = ["FORMATS", "Format", "Sample", "samples_of", "format_rows", "check_format"]

Format = Literal["tokentape", "openrlhf", "atropos", "verifiers", "stepwise", "packed"]
FORMATS: tuple[Format, ...] = ("tokentape", "openrlhf", "atropos", "verifiers", "stepwise", "packed")
ATROPOS_MASKED = -100
ATROPOS_MASKED_LOGPROB = 1.0


def check_format(value: str) -> Format:
    for known in FORMATS:
        if value == known:
            return known
    raise InvalidRequest(f"format must be one of {', '.join(FORMATS)}", param="format")


_NO_IMAGES: Mapping[str, DecodedImage] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Sample:
    """One branch of one session with everything known about the episode; `images`: the bytes of
    the images it shows, by digest (the tree keeps their facts only)."""

    tree: SessionTree
    branch: BranchView
    images: Mapping[str, DecodedImage] = field(default_factory=lambda: _NO_IMAGES)

    @property
    def reward(self) -> float | None:
        return self.tree.outcome.branch_reward(self.branch.leaf.id)

    def versions_of(self, node: Any) -> list[int]:
        """The version of each sampled token of one turn on this branch (-1: not known)."""
        return [-1 if v is None else v for v in node_versions(node)]

    def head(self) -> dict[str, Any]:
        outcome = self.tree.outcome
        return {
            "schema_version": EXPORT_SCHEMA_VERSION,
            "session_id": self.tree.session_id,
            "rollout_id": self.tree.session_id,  # one rollout, one vote: see loss_weight
            "branch_id": self.branch.leaf.id,
            "group_id": outcome.group_id,
            "reward": self.reward,
            "finished": outcome.finished,
            "metadata": outcome.metadata,
            "policy_versions": [node.policy_version for node in self.branch.nodes],  # one per turn
            # one per turn: sampled under a constraint, so its logprobs are not the free policy's
            "constrained": [node.constrained for node in self.branch.nodes],
            # weights versions: per token (AReaL), oldest/newest (verl), per-turn spans
            **version_fields(self.branch),
        }


def samples_of(trees: Iterable[SessionTree], images: Mapping[str, DecodedImage] | None = None) -> list[Sample]:
    """Every branch of `trees`; `images`: the bytes of the images they show, by digest."""
    shown = _NO_IMAGES if images is None else images
    return [Sample(tree, branch, shown) for tree in trees for branch in tree.branches()]


def _tokentape(sample: Sample) -> dict[str, Any]:
    turn_rewards = sample.tree.outcome.turn_rewards
    branch = export_branch(sample.branch, sample.images)
    row = {**sample.head(), **branch, "logprob_mode": common_logprob_mode(branch["logprob_modes"])}
    row["turn_rewards"] = [turn_rewards.get(node.id) for node in sample.branch.nodes]
    return row


def _openrlhf(sample: Sample) -> dict[str, Any]:
    branch = sample.branch
    return {
        **sample.head(),
        "observation_tokens": branch.tokens,
        "action_ranges": [list(r) for r in branch.action_ranges()],
        "rollout_log_probs": [0.0 if lp is None else lp for lp in branch.logprobs],
        "truncated": branch.leaf.finish_reason == "length",
        **image_fields(branch, sample.images),
    }


def _verifiers(sample: Sample) -> dict[str, Any]:
    branch = sample.branch
    ranges = branch.action_ranges()
    split = ranges[0][0] if ranges else len(branch.tokens)
    mask = branch.loss_mask
    return {
        **sample.head(),
        "prompt_ids": branch.tokens[:split],
        "prompt_mask": [0] * split,
        "completion_ids": branch.tokens[split:],
        "completion_mask": mask[split:],
        "completion_logprobs": [0.0 if lp is None else lp for lp in branch.logprobs[split:]],
        "is_truncated": branch.leaf.finish_reason == "length",
        **image_fields(branch, sample.images),
    }


def _stepwise(sample: Sample) -> list[dict[str, Any]]:
    branch = sample.branch
    turn_rewards = sample.tree.outcome.turn_rewards
    rows = []
    nodes = {node.sampled_start: node for node in branch.nodes}
    for step, (start, end) in enumerate(branch.action_ranges()):
        node = nodes[start]
        rows.append(
            {
                **sample.head(),
                "step": step,
                "turn_id": node.id,
                "reward": turn_rewards.get(node.id, sample.reward),
                "policy_version": node.policy_version,
                "completion_versions": sample.versions_of(node)[: end - start],
                "constrained": node.constrained,
                "prompt_ids": branch.tokens[:start],
                "completion_ids": branch.tokens[start:end],
                "completion_logprobs": branch.logprobs[start:end],
                "finish_reason": node.finish_reason,
            }
        )
    return rows


def _atropos(samples: Sequence[Sample], weighting: Weighting = "rows") -> list[dict[str, Any]]:
    groups: dict[str | None, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.tree.outcome.group_id or f"session:{sample.tree.session_id}", []).append(sample)
    rows = []
    for group_id, members in groups.items():
        versions = [version_fields(m.branch) for m in members]
        rows.append(
            {
                "schema_version": EXPORT_SCHEMA_VERSION,
                "group_id": group_id,
                "session_ids": [m.tree.session_id for m in members],
                "branch_ids": [m.branch.leaf.id for m in members],
                "tokens": [m.branch.tokens for m in members],
                "masks": [
                    [t if keep else ATROPOS_MASKED for t, keep in zip(m.branch.tokens, m.branch.loss_mask, strict=True)]
                    for m in members
                ],
                "inference_logprobs": [
                    [ATROPOS_MASKED_LOGPROB if lp is None else lp for lp in m.branch.logprobs] for m in members
                ],
                "scores": [m.reward for m in members],
                "rollout_ids": [m.tree.session_id for m in members],
                "loss_weights": loss_weights(
                    [m.tree.session_id for m in members], [sum(m.branch.loss_mask) for m in members], weighting
                ),
                "policy_versions": [[node.policy_version for node in m.branch.nodes] for m in members],
                "versions": [fields["versions"] for fields in versions],
                "param_version_start": [fields["param_version_start"] for fields in versions],
                "param_version_end": [fields["param_version_end"] for fields in versions],
                "policy_spans": [fields["policy_spans"] for fields in versions],
                "constrained": [[node.constrained for node in m.branch.nodes] for m in members],
            }
        )
    return rows


def format_rows(
    samples: Sequence[Sample], fmt: Format, *, lag: LagWindow | None = None, weighting: Weighting = "rows"
) -> list[dict[str, Any]]:
    """Rows of a dataset in `fmt`: one per branch, per turn (stepwise), per group (atropos) or per
    group's packed tree (packed). Every row of a rollout (a session) carries `rollout_id` and a
    `loss_weight` by `weighting` (`core.rollouts`): by default one vote per rollout, however many
    rows it has.

    `lag` (an export's max_lag): `drop` leaves out every sample with a token sampled under a version
    older than `lag.oldest`; `mask` keeps them and takes those tokens out of the loss (the formats
    with a per-token mask: tokentape, verifiers)."""
    if lag is not None:
        if lag.mode == "drop":
            samples = [s for s in samples if not _too_old(s, lag)]
        elif fmt not in ("tokentape", "verifiers"):
            raise InvalidRequest("max_lag with mask needs a per-token mask: format tokentape or verifiers")
        else:
            return [_masked(row, lag, fmt) for row in format_rows(samples, fmt, weighting=weighting)]
    if fmt == "atropos":
        return _atropos(samples, weighting)
    if fmt == "packed":
        return _packed(samples, weighting)
    if fmt == "stepwise":
        rows = [row for sample in samples for row in _stepwise(sample)]
    else:
        build = {"tokentape": _tokentape, "openrlhf": _openrlhf, "verifiers": _verifiers}[fmt]
        rows = [build(sample) for sample in samples]
    sampled = [_sampled_count(row) for row in rows]
    for row, weight in zip(rows, loss_weights([row["rollout_id"] for row in rows], sampled, weighting), strict=True):
        row["loss_weight"] = weight
    return rows


def _sampled_count(row: dict[str, Any]) -> int:
    """The sampled tokens of a row, whatever its format."""
    if "action_ranges" in row:
        return sum(end - start for start, end in row["action_ranges"])
    if "completion_mask" in row:
        return sum(row["completion_mask"])
    return len(row["completion_ids"])  # stepwise: the turn's own tokens


def _packed(samples: Sequence[Sample], weighting: Weighting) -> list[dict[str, Any]]:
    """One packed row per group (a session without a group is its own): its sessions' branches as one
    tree, every shared token once (`core.packed`)."""
    rows = format_rows(samples, "tokentape", weighting=weighting)
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["group_id"] or f"session:{row['session_id']}", []).append(row)
    packed = []
    for group_id, members in groups.items():
        packed.append(
            {
                "schema_version": EXPORT_SCHEMA_VERSION,
                "group_id": group_id,
                "session_ids": list(dict.fromkeys(m["session_id"] for m in members)),
                **pack_branches(members),
            }
        )
    return packed


def _too_old(sample: Sample, lag: LagWindow) -> bool:
    return any(0 <= v < lag.oldest for v in version_fields(sample.branch)["versions"])


def _masked(row: dict[str, Any], lag: LagWindow, fmt: Format) -> dict[str, Any]:
    versions: list[int] = row["versions"]
    old = [0 <= v < lag.oldest for v in versions]
    if fmt == "tokentape":
        mask = [0 if too_old else m for m, too_old in zip(row["loss_mask"], old, strict=True)]
        return {**row, "loss_mask": mask, "masked_by_lag": sum(old)}
    split = len(row["prompt_ids"])
    mask = [0 if too_old else m for m, too_old in zip(row["completion_mask"], old[split:], strict=True)]
    return {**row, "completion_mask": mask, "masked_by_lag": sum(old)}

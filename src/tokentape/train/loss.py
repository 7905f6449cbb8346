"""From exported sessions to a policy-gradient loss: token IDs, loss mask and logprobs as the tape
recorded them (no tokenizer), group-normalised advantages, token-level truncated importance weights.

Per sampled token t of an episode with advantage A:

    w_t    = min(exp(logp_trainer_old(t) - logp_engine(t)), clip)     # TIS, no gradient
    loss   = -sum_t w_t * A * logp_trainer(t) / (sampled tokens in the batch)

`logp_trainer_old` is the trainer's policy before this update (one optimizer step per batch, so it
is the current parameters, detached): w corrects for what the engine sampled under slightly different
numerics (or older weights) than the trainer computes. What enters the loss:

- **sampled tokens only**: the tape's loss mask; prompts, tool results and turn closes are never
  trained on.
- **constrained turns** (`constrained`: a grammar masked the engine's distribution, its logprobs are
  of that masked distribution, which the trainer cannot recompute) are left out of the loss.
- **stale tokens** (sampled under a policy version older than `max_staleness` versions behind the
  trainer's: the export's per-token `versions`, since a turn continued across a weight update holds
  several; the turn's label where a token's version is not known) are left out; newer off-policy
  tokens are kept, weighted by w against the logprobs the engine recorded for them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Batch",
    "Sample",
    "advantages",
    "build_batch",
    "check_sampling",
    "episode_reward",
    "loss_and_metrics",
    "samples_from_export",
    "token_logprobs",
    "trainable",
]


@dataclass(slots=True)
class Sample:
    """One exported branch, as the trainer uses it."""

    session_id: str
    group_id: str
    tokens: list[int]
    mask: list[bool]  # trained on: sampled, not constrained, not stale
    engine_logprobs: list[float]  # 0.0 where not sampled
    reward: float
    versions: list[int | None]  # per token: the policy version that sampled it (None off the mask)
    dropped: dict[str, int] = field(default_factory=dict)  # sampled tokens left out, by reason
    loss_weight: float = 1.0  # the branch's share of its rollout's (session's) one vote


# Recorded only when a turn set them (`SamplingParams.reshaping`): each changes the logits before the temperature.
RESHAPING = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty")


def check_sampling(export: dict[str, Any], branch: dict[str, Any], expected: Mapping[str, float]) -> None:
    """Every sampled turn of `branch` was sampled with the settings the trainer computes its logprobs
    under (`expected`: temperature, top_p, top_k, min_p): ValueError naming the turn otherwise, so a
    mismatch is an error, never a silent bias."""
    recorded = branch.get("sampling") or [None] * len(branch["turn_ids"])
    for k, (start, end) in enumerate(branch["action_ranges"]):
        if end <= start:
            continue  # nothing sampled: nothing to train on
        index = _turn_of(branch, k, start)
        turn, settings = branch["turn_ids"][index], recorded[index]
        where = f"session {export['session_id']} turn {turn}"
        if settings is None:
            raise ValueError(f"{where} records no sampling settings; the trainer needs {dict(expected)}")
        differ = {
            name: settings.get(name)
            for name, value in expected.items()
            if not (isinstance(settings.get(name), (int, float)) and math.isclose(settings[name], value))
        }
        # a bias or a penalty the trainer does not apply reshaped the distribution the token came from
        differ.update({name: settings[name] for name in RESHAPING if name in settings and name not in expected})
        if differ:
            wanted = {name: expected.get(name, "not applied") for name in differ}
            raise ValueError(f"{where} was sampled with {differ}; the trainer computes its logprobs with {wanted}")


def samples_from_export(
    export: dict[str, Any],
    *,
    version: int | None = None,
    max_staleness: int = 1,
    logprob_mode: str | None = None,
    sampling: Mapping[str, float] | None = None,
    missing_reward: float = 0.0,
) -> list[Sample]:
    """The branches of one exported session (tokentape format). `version`: the trainer's policy
    version now, for staleness; `logprob_mode`: the mode the trainer recomputes (checked);
    `sampling`: the settings it recomputes them under (checked on every sampled turn).

    One rule for an episode that went wrong: with no reward (the agent raised) it is rewarded
    `missing_reward`; with no branch at all (it failed before its first turn) it is one sample with
    no token. Either way it stays a member of its group, so the group's advantages are those of
    the group as sampled; a sample with nothing to train on is left out of the batch after that."""
    group_id = str(export.get("summary", {}).get("group_id") or export["session_id"])
    if not export["branches"]:
        return [Sample(str(export["session_id"]), group_id, [], [], [], missing_reward, [])]
    samples = []
    for branch in export["branches"]:
        if logprob_mode is not None:
            modes = {m for m in branch["logprob_modes"] if m is not None}
            if modes - {logprob_mode}:
                raise ValueError(f"session {export['session_id']}: logprobs are {sorted(modes)}, not {logprob_mode}")
        if sampling is not None:
            check_sampling(export, branch, sampling)
        tokens = list(branch["tokens"])
        mask = [bool(m) for m in branch["loss_mask"]]
        versions: list[int | None] = [None] * len(tokens)
        dropped = {"constrained": 0, "stale": 0}
        # per token (a turn continued across a weight update holds several versions; -1: not known)
        per_token: list[int] = branch.get("versions") or [-1] * len(tokens)
        for k, (start, end) in enumerate(branch["action_ranges"]):
            if end <= start:
                continue
            index = _turn_of(branch, k, start)
            constrained, label = branch["constrained"][index], _version_number(branch["policy_versions"][index])
            for i in range(start, end):
                number = per_token[i] if per_token[i] >= 0 else label
                versions[i] = number
                stale = version is not None and number is not None and version - number > max_staleness
                if mask[i] and (constrained or stale):
                    mask[i] = False
                    dropped["constrained" if constrained else "stale"] += 1
        reward = branch.get("reward")
        samples.append(
            Sample(
                session_id=str(export["session_id"]),
                group_id=group_id,
                tokens=tokens,
                mask=mask,
                engine_logprobs=[0.0 if lp is None else float(lp) for lp in branch["logprobs"]],
                reward=missing_reward if reward is None else float(reward),
                versions=versions,
                dropped=dropped,
                loss_weight=float(branch.get("loss_weight", 1.0)),
            )
        )
    return samples


def _turn_of(branch: dict[str, Any], k: int, start: int) -> int:
    """The turn (its index in the branch's per-turn lists) of the k-th sampled span, which starts at
    `start`. Spans and turns differ in number where a fork cut a turn's whole reply off the branch
    (the turn is on the path with no sampled token): the per-token `turn_index` says which; a row
    without it (built by hand) pairs them in order."""
    turn_index = branch.get("turn_index")
    return int(turn_index[start]) if turn_index else k


def _version_number(version: Any) -> int | None:
    """A turn's weights version: None (recorded before any update) is version 0, the base weights."""
    if version is None:
        return 0
    try:
        return int(version)
    except (TypeError, ValueError):
        return None


def advantages(samples: Sequence[Sample], eps: float = 1e-6) -> list[float]:
    """GRPO, one vote per rollout: each rollout's (session's) reward minus its group's mean over the
    group's rollouts, over their standard deviation (0 for a group whose rollouts all scored the same:
    it teaches nothing). A rollout of several branches is one member of its group, its reward the
    weighted mean of its branches'; each of its branches carries its advantage."""
    rollouts: dict[str, tuple[str, float, float]] = {}  # session -> group, weighted reward sum, weight sum
    for s in samples:
        group, total, weights = rollouts.get(s.session_id, (s.group_id, 0.0, 0.0))
        rollouts[s.session_id] = (group, total + s.reward * s.loss_weight, weights + s.loss_weight)
    reward = {sid: total / weights if weights > 0 else 0.0 for sid, (_, total, weights) in rollouts.items()}
    groups: dict[str, list[float]] = defaultdict(list)
    for sid, (group, _, _) in rollouts.items():
        groups[group].append(reward[sid])
    result = []
    for s in samples:
        rewards = groups[s.group_id]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        result.append((reward[s.session_id] - mean) / (std + eps) if std > 0 else 0.0)
    return result


@dataclass(slots=True)
class Batch:
    input_ids: Any  # LongTensor [B, T], right-padded
    attention: Any  # [B, T]
    mask: Any  # float [B, T]: 1 where the token at t is trained on (its logprob comes from t-1)
    engine_logprobs: Any  # float [B, T]
    advantages: Any  # float [B]
    weights: Any = None  # float [B]: each row's loss_weight (None: 1.0 each)


def episode_reward(export: dict[str, Any], missing_reward: float = 0.0) -> float:
    """An episode's reward as the loss counts it (`samples_from_export`'s rule): what its agent
    returned, or `missing_reward` when it returned none. What the loop plots is the mean of these."""
    reward = export.get("summary", {}).get("reward")
    return missing_reward if reward is None else float(reward)


def trainable(samples: Sequence[Sample]) -> tuple[list[Sample], list[float]]:
    """The samples with a token to train on, each with its advantage over its whole group as
    sampled (samples with nothing to train on count in their group's mean and spread)."""
    kept = [(s, a) for s, a in zip(samples, advantages(samples), strict=True) if any(s.mask)]
    return [s for s, _ in kept], [a for _, a in kept]


def build_batch(samples: Sequence[Sample], pad_id: int = 0, advantages_: Sequence[float] | None = None) -> Batch:
    """`advantages_`: each sample's advantage, computed over its whole group (`trainable`); None:
    over `samples` as given."""
    import torch

    length = max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), length), dtype=torch.long)
    mask = torch.zeros((len(samples), length))
    engine = torch.zeros((len(samples), length))
    for row, s in enumerate(samples):
        n = len(s.tokens)
        ids[row, :n] = torch.tensor(s.tokens)
        attention[row, :n] = 1
        mask[row, :n] = torch.tensor(s.mask, dtype=torch.float32)
        engine[row, :n] = torch.tensor(s.engine_logprobs)
    mask[:, 0] = 0.0  # the first token has no context to predict it from
    given = advantages(samples) if advantages_ is None else list(advantages_)
    weights = torch.tensor([s.loss_weight for s in samples], dtype=torch.float32)
    return Batch(ids, attention, mask, engine, torch.tensor(given), weights)


def token_logprobs(model: Any, batch: Batch, temperature: float) -> Any:
    """log p(token_t | tokens_<t) at the engine's temperature where the batch trains on token t, [B, T]
    (0 elsewhere). The LM head runs on those positions only: sampled tokens are a fraction of a
    sequence, and the head (49k-token vocabulary) is most of the cost."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.model(input_ids=batch.input_ids, attention_mask=batch.attention).last_hidden_state
    positions = batch.mask[:, 1:].bool()  # token t is predicted from position t - 1
    logits = base.lm_head(hidden[:, :-1][positions])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # at least float32
    picked = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:][positions][:, None])[:, 0]
    full = torch.zeros(positions.shape, dtype=picked.dtype).masked_scatter(positions, picked)
    return torch.nn.functional.pad(full, (1, 0))


def loss_and_metrics(trainer_logprobs: Any, batch: Batch, clip: float) -> tuple[Any, dict[str, float]]:
    """The TIS policy-gradient loss and the engine/trainer mismatch on the trained tokens."""
    import torch

    mask = batch.mask
    count = mask.sum().clamp(min=1.0)
    on = mask.bool()
    old = trainer_logprobs.detach()
    log_ratio = old - batch.engine_logprobs  # trainer over engine, per sampled token
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=clip)
    # a token-weighted mean in which each row counts by its loss_weight: a rollout of k rows, one vote
    rows = torch.ones(mask.shape[0]) if batch.weights is None else batch.weights
    weighted = mask * rows[:, None]
    loss = -(weight * batch.advantages[:, None] * trainer_logprobs * weighted).sum() / weighted.sum().clamp(min=1e-12)
    metrics = {"tokens": float(count), **mismatch(log_ratio[on], clip), "loss": float(loss.detach())}
    return loss, metrics


def mismatch(log_ratio: Any, clip: float) -> dict[str, float]:
    """The engine/trainer mismatch over trained tokens, from log(p_trainer / p_engine) of each [N]."""
    import torch

    if log_ratio.numel() == 0:
        raise ValueError("no sampled token to train on: check the loss mask")
    ratio = torch.exp(log_ratio)
    difference = log_ratio.abs()
    # k3 estimator of KL(engine || trainer) from tokens the engine sampled: r - 1 - log r, r = p_t / p_e
    return {
        "logprob_diff_mean": float(difference.mean()),
        "logprob_diff_max": float(difference.max()),
        "kl_k3": float((ratio - 1.0 - log_ratio).mean()),
        "ratio_min": float(ratio.min()),
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "clipped_share": float((ratio > clip).float().mean()),
    }

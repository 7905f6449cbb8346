"""The policy-gradient loss on packed rows: a group's branches as one tree, every shared token
forwarded once (`core.packed`), the same loss as per branch.

Each packed token attends to its ancestors and itself (a 4D attention mask) at its depth on its own
path (position ids), so its hidden state is the one it has in each branch that holds it; a token is
predicted at its parent's position. With w_b the branch's loss weight and A_b its advantage, the
per-branch loss is

    -sum_b w_b A_b sum_{t in b} TIS_t logp(t) / sum_b w_b |b|        (|b|: trained tokens of b)

and a token held by several branches is one term whose coefficient is sum_{b holds t} w_b A_b, over
a denominator that counts it sum_{b holds t} w_b times: the same number, and the same gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.packed import attention_mask, pack_branches
from tokentape.train.loss import Sample

__all__ = ["PackedBatch", "branch_rows", "build_packed", "packed_groups", "packed_loss", "packed_token_logprobs"]


@dataclass(slots=True)
class PackedBatch:
    input_ids: Any  # LongTensor [1, N]
    position_ids: Any  # LongTensor [1, N]: each token's depth on its path
    attention: Any  # float [1, 1, N, N]: 0 where a token may attend, the dtype's minimum elsewhere; None: causal
    parents: Any  # LongTensor [N]: where each token is predicted from (-1: a root)
    mask: Any  # float [N]: trained on
    engine_logprobs: Any  # float [N]
    coefficient: Any  # float [N]: sum over the branches holding the token of loss_weight x advantage
    weight: Any  # float [N]: sum over the branches holding the token of loss_weight (the denominator's)
    branch_tokens: int  # tokens the per-branch batch would forward


def build_packed(samples: Sequence[Sample], advantages: Sequence[float], dtype: Any = None) -> PackedBatch:
    """The packed row of `samples` (a group's branches, any number of sessions)."""
    import torch

    row = pack_branches(branch_rows(samples))
    parents: list[int] = row["parents"]
    n = len(parents)
    trained = [bool(m) and p >= 0 for m, p in zip(row["loss_mask"], parents, strict=True)]  # a root has no context
    coefficient = [0.0] * n
    weight = [0.0] * n
    for sample, advantage, end in zip(samples, advantages, row["branch_ends"], strict=True):
        at = end
        while at >= 0:  # the branch: its last token and that token's ancestors
            if trained[at]:
                coefficient[at] += sample.loss_weight * advantage
                weight[at] += sample.loss_weight
            at = parents[at]
    float_type = dtype or torch.float32
    attention = None  # one chain (a single branch): the model's own causal mask, no N x N tensor
    if any(p != i - 1 for i, p in enumerate(parents)):
        blocked = ~attention_mask(parents)
        attention = torch.zeros((1, 1, n, n), dtype=float_type).masked_fill_(blocked, torch.finfo(float_type).min)
    return PackedBatch(
        input_ids=torch.tensor([row["tokens"]]),
        position_ids=torch.tensor([row["position_ids"]]),
        attention=attention,
        parents=torch.tensor(parents),
        mask=torch.tensor(trained, dtype=float_type),
        engine_logprobs=torch.tensor([0.0 if lp is None else lp for lp in row["logprobs"]], dtype=float_type),
        coefficient=torch.tensor(coefficient, dtype=float_type),
        weight=torch.tensor(weight, dtype=float_type),
        branch_tokens=sum(len(s.tokens) for s in samples),
    )


def packed_groups(
    samples: Sequence[Sample], advantages: Sequence[float], dtype: Any = None, *, max_tokens: int = 2048
) -> list[tuple[PackedBatch, float]]:
    """A batch as packed rows, each with its share of the batch's weighted trained tokens: the sum of
    share x `packed_loss` over the rows is the per-branch batch's loss. Branches are taken group by
    group (a group's sessions share a prompt) into rows of at most `max_tokens` packed tokens: small
    groups share a row (a forest: one forward of many tokens costs less than many of few), a large
    tree is split between rows by whole branches (the attention mask is dense: N x N). A branch longer
    than `max_tokens` is a row of its own, a plain causal sequence."""
    rank = {group: n for n, group in enumerate(dict.fromkeys(s.group_id for s in samples))}
    order = sorted(range(len(samples)), key=lambda i: rank[samples[i].group_id])  # stable: groups whole, in order
    bins: list[list[int]] = []
    for index in order:
        if bins and _packed_size([samples[i] for i in (*bins[-1], index)]) <= max_tokens:
            bins[-1].append(index)
        else:
            bins.append([index])
    rows = [build_packed([samples[i] for i in members], [advantages[i] for i in members], dtype) for members in bins]
    weights = [float((row.weight * row.mask).sum()) for row in rows]
    total = sum(weights) or 1.0
    return [(row, weight / total) for row, weight in zip(rows, weights, strict=True)]


def _packed_size(samples: Sequence[Sample]) -> int:
    return len(pack_branches(branch_rows(samples))["tokens"])


def branch_rows(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """The trainer's samples as the branches `pack_branches` merges (what it keys a shared token on)."""
    return [
        {
            "tokens": s.tokens,
            "loss_mask": [int(m) for m in s.mask],
            "logprobs": [lp if m else None for lp, m in zip(s.engine_logprobs, s.mask, strict=True)],
            "rollout_id": s.session_id,
            "loss_weight": s.loss_weight,
        }
        for s in samples
    ]


def packed_token_logprobs(model: Any, batch: PackedBatch, temperature: float) -> Any:
    """log p(token | its ancestors) at the engine's temperature for every trained token, [N] (0
    elsewhere); the LM head runs on the trained tokens' parents only."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.model(
        input_ids=batch.input_ids, attention_mask=batch.attention, position_ids=batch.position_ids
    ).last_hidden_state[0]
    trained = batch.mask.bool()
    logits = base.lm_head(hidden[batch.parents[trained]])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # at least float32
    picked = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[0][trained][:, None])[:, 0]
    return torch.zeros(batch.mask.shape, dtype=picked.dtype).masked_scatter(trained, picked)


def packed_loss(trainer_logprobs: Any, batch: PackedBatch, clip: float) -> tuple[Any, dict[str, float]]:
    """The TIS policy-gradient loss of `loss.loss_and_metrics`, on a packed row."""
    import torch

    old = trainer_logprobs.detach()
    ratio = torch.exp(old - batch.engine_logprobs)
    tis = torch.clamp(ratio, max=clip)
    denominator = (batch.weight * batch.mask).sum().clamp(min=1e-12)
    loss = -(tis * batch.coefficient * trainer_logprobs * batch.mask).sum() / denominator
    # the mismatch figures are the trainer's, over every row of a step (`loss.mismatch`)
    return loss, {
        "tokens_forwarded": float(batch.input_ids.shape[1]),
        "branch_tokens": float(batch.branch_tokens),
        "loss": float(loss.detach()),
    }

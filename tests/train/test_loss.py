"""The loss from a tape: advantages per group, exactly the sampled tokens (a broken mask goes red),
constrained and stale turns left out, the mismatch figures from their definitions. No model: a tiny
stand-in whose logprobs are known, so every number is computed independently here."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tokentape.train.loss import (  # noqa: E402
    advantages,
    build_batch,
    loss_and_metrics,
    samples_from_export,
    token_logprobs,
)


def _export(
    session: str, group: str, reward: float, *, constrained: bool = False, version: Any = None
) -> dict[str, Any]:
    """One two-turn branch: prompt [0:3), sampled [3:5), bridge [5:7), sampled [7:9)."""
    tokens = [1, 5, 6, 7, 8, 2, 3, 9, 4]
    mask = [False, False, False, True, True, False, False, True, True]
    logprobs = [None, None, None, -0.5, -1.0, None, None, -0.25, -2.0]
    return {
        "session_id": session,
        "summary": {"group_id": group},
        "branches": [
            {
                "tokens": tokens,
                "loss_mask": mask,
                "logprobs": logprobs,
                "action_ranges": [[3, 5], [7, 9]],
                "constrained": [False, constrained],
                "policy_versions": [version, version],
                "logprob_modes": ["temperature_scaled_untruncated"] * 2,
                "reward": reward,
            }
        ],
    }


class Table(torch.nn.Module):  # type: ignore[misc]
    """A 'model' whose next-token distribution depends on the previous token only: a logit table."""

    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.logits = torch.nn.Parameter(torch.randn(vocab, vocab, generator=generator))
        self.model = self  # the backbone and the head, as token_logprobs reaches them
        self.lm_head = lambda hidden: hidden

    def forward(self, input_ids: Any, attention_mask: Any) -> Any:
        class Out:
            last_hidden_state = self.logits[input_ids]

        return Out()


def test_group_normalised_advantages() -> None:
    samples = [
        s
        for i, r in enumerate([1.0, 0.0, 0.5, 0.5])
        for s in samples_from_export(_export(f"s{i}", "g" + str(i // 2), r))
    ]
    assert advantages(samples) == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)


def test_the_loss_is_over_exactly_the_sampled_tokens_with_truncated_importance_weights() -> None:
    samples = samples_from_export(_export("a", "g", 1.0)) + samples_from_export(_export("b", "g", 0.0))
    samples[1].tokens[4], samples[1].tokens[8] = 6, 5  # the other member sampled other tokens
    samples[1].engine_logprobs[4] = -3.0
    model, temperature, clip = Table(), 0.8, 1.5
    batch = build_batch(samples)
    logprobs = token_logprobs(model, batch, temperature)
    loss, metrics = loss_and_metrics(logprobs, batch, clip)

    # independently: walk each sequence, score only the positions the tape says were sampled
    table = torch.log_softmax(model.logits.detach() / temperature, dim=-1)
    expected, diffs, k3s, ratios = 0.0, [], [], []
    for sample, advantage in zip(samples, (1.0, -1.0), strict=True):
        for t, (token, sampled) in enumerate(zip(sample.tokens, sample.mask, strict=True)):
            if not sampled:
                continue
            mine = float(table[sample.tokens[t - 1], token])
            engine = sample.engine_logprobs[t]
            ratio = math.exp(mine - engine)
            expected += -min(ratio, clip) * advantage * mine
            diffs.append(abs(mine - engine))
            k3s.append(ratio - 1 - math.log(ratio))
            ratios.append(ratio)
    assert len(diffs) == 8
    assert float(loss.detach()) == pytest.approx(expected / 8, rel=1e-5)
    assert metrics["tokens"] == 8
    assert metrics["logprob_diff_mean"] == pytest.approx(sum(diffs) / 8, rel=1e-5)
    assert metrics["logprob_diff_max"] == pytest.approx(max(diffs), rel=1e-5)
    assert metrics["kl_k3"] == pytest.approx(sum(k3s) / 8, rel=1e-4)
    assert metrics["ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert metrics["clipped_share"] == pytest.approx(sum(r > clip for r in ratios) / 8)

    # a mask that also covers the prompt and bridge tokens trains on what the model never sampled
    broken = build_batch(samples)
    broken.mask[:, 1:] = broken.attention[:, 1:].float()
    wrong, _ = loss_and_metrics(token_logprobs(model, broken, temperature), broken, clip)
    assert float(wrong.detach()) != pytest.approx(float(loss.detach()), rel=1e-3)


def test_constrained_and_stale_turns_are_left_out() -> None:
    (constrained,) = samples_from_export(_export("c", "g", 1.0, constrained=True))
    assert constrained.mask[7:9] == [False, False] and constrained.mask[3:5] == [True, True]
    assert constrained.dropped == {"constrained": 2, "stale": 0}
    (stale,) = samples_from_export(_export("s", "g", 1.0, version="3"), version=5, max_staleness=1)
    assert not any(stale.mask) and stale.dropped["stale"] == 4
    (fresh,) = samples_from_export(_export("f", "g", 1.0, version="4"), version=5, max_staleness=1)
    assert sum(fresh.mask) == 4 and fresh.versions[3] == 4 and fresh.versions[0] is None
    with pytest.raises(ValueError, match="not raw"):
        samples_from_export(_export("m", "g", 1.0), logprob_mode="raw")


def test_a_turn_that_crossed_a_weight_update_is_judged_token_by_token() -> None:
    """A turn continued across an update holds tokens of two versions; its label is the first one's.
    Staleness and the versions follow the export's per-token `versions`, not the turn's label."""
    export = _export("x", "g", 1.0, version="3")  # turn 1 began under 3, turn 2 ran under 4
    export["branches"][0]["policy_versions"] = ["3", "4"]
    export["branches"][0]["versions"] = [-1, -1, -1, 3, 4, -1, -1, 4, 4]
    (sample,) = samples_from_export(export, version=5, max_staleness=1)
    assert sample.versions == [None, None, None, 3, 4, None, None, 4, 4]
    assert sample.mask == [False, False, False, False, True, False, False, True, True]
    assert sample.dropped == {"constrained": 0, "stale": 1}


TRAINER_SAMPLING = {"temperature": 0.8, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def test_a_turn_sampled_with_other_settings_than_the_trainers_is_an_error_naming_it() -> None:
    export = _export("s", "g", 1.0)
    branch = export["branches"][0]
    branch["turn_ids"] = [4, 9]
    branch["sampling"] = [dict(TRAINER_SAMPLING), dict(TRAINER_SAMPLING)]
    assert len(samples_from_export(export, sampling=TRAINER_SAMPLING)) == 1  # all as the trainer computes
    for name, value in (("temperature", 1.0), ("top_p", 0.9), ("top_k", 40), ("min_p", 0.05)):
        branch["sampling"][1] = {**TRAINER_SAMPLING, name: value}
        with pytest.raises(ValueError, match=rf"session s turn 9 was sampled with \{{'{name}': {value}\}}"):
            samples_from_export(export, sampling=TRAINER_SAMPLING)
    branch["sampling"][1] = None  # recorded before turns kept their settings: not known, not assumed
    with pytest.raises(ValueError, match="session s turn 9 records no sampling settings"):
        samples_from_export(export, sampling=TRAINER_SAMPLING)

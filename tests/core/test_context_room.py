"""What fits in the context, at every edge: a request fits when prompt + max_tokens (1 when unset) is at
most the context; clipping gives the room left while the prompt leaves at least one token; token ids
outside the vocabulary are refused before anything else."""

from __future__ import annotations

import pytest

from tokentape.core.context_room import clips_max_tokens, fit_to_context, overflow_from_floor, prompt_room
from tokentape.core.sampling import SamplingParams
from tokentape.errors import ContextOverflow, InvalidRequest

CONTEXT = 100
VOCAB = 50


@pytest.mark.parametrize("max_tokens", [None, 1, 10, 99, 100, 101])
@pytest.mark.parametrize("prompt", [0, 1, 50, 89, 90, 91, 99, 100, 101, 150])
@pytest.mark.parametrize("clip", [False, True])
def test_every_prompt_and_max_tokens_at_the_edges(max_tokens: int | None, prompt: int, clip: bool) -> None:
    sampling = SamplingParams(max_tokens=max_tokens)
    asked = max_tokens or 1
    if prompt + asked <= CONTEXT:
        assert fit_to_context(prompt, CONTEXT, VOCAB, sampling, clip) is sampling
    elif clip and prompt < CONTEXT:
        assert fit_to_context(prompt, CONTEXT, VOCAB, sampling, clip).max_tokens == CONTEXT - prompt
    else:
        with pytest.raises(ContextOverflow) as refused:
            fit_to_context(prompt, CONTEXT, VOCAB, sampling, clip)
        error = refused.value
        assert (error.prompt_tokens, error.max_tokens, error.context_length) == (prompt, asked, CONTEXT)
        assert error.param == ("max_tokens" if prompt < CONTEXT else "messages")
        assert f"needs {prompt + asked}" in str(error)
    # the room before the prompt is known admits exactly the prompts that then fit (or clip)
    fits = prompt <= prompt_room(CONTEXT, sampling, clip)
    assert fits == (prompt + asked <= CONTEXT or (clip and prompt < CONTEXT))


@pytest.mark.parametrize(
    ("sampling", "field", "token"),
    [
        (SamplingParams(stop_token_ids=(3, VOCAB)), "stop_token_ids", VOCAB),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids", -1),
        (SamplingParams(logit_bias=((VOCAB + 7, 1.0),)), "logit_bias", VOCAB + 7),
    ],
)
def test_a_token_outside_the_vocabulary_is_refused_first(sampling: SamplingParams, field: str, token: int) -> None:
    with pytest.raises(InvalidRequest) as refused:
        fit_to_context(10**6, CONTEXT, VOCAB, sampling, clip=False)  # would overflow too: the vocabulary speaks first
    assert not isinstance(refused.value, ContextOverflow)
    assert refused.value.param == field and f"token {token}" in str(refused.value)
    assert (
        fit_to_context(1, CONTEXT, VOCAB, SamplingParams(stop_token_ids=(VOCAB - 1, 0)), clip=False).max_tokens is None
    )


def test_the_refusal_from_a_floor_names_what_is_wanted_unless_clipping() -> None:
    refused = overflow_from_floor(CONTEXT, 120, SamplingParams(max_tokens=7), clip=False)
    assert refused.param == "messages" and "at least 120" in str(refused) and "7 more to generate" in str(refused)
    assert "to generate" not in str(overflow_from_floor(CONTEXT, 120, SamplingParams(max_tokens=7), clip=True))


def test_who_clips() -> None:
    assert not clips_max_tokens(False, {})
    assert not clips_max_tokens(False, {"max_tokens": "refuse"})
    assert clips_max_tokens(True, {})
    assert clips_max_tokens(False, {"max_tokens": "clip"})
    assert clips_max_tokens(False, {"harness": "codex"})

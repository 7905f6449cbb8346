"""What fits in the model's context: the room a prompt may take, and a request's `max_tokens` held
against it (refused as OpenAI refuses it, or clipped to the room left, as trainers' own servers do).

Pure arithmetic over the context length, the prompt's length and the request's sampling: the gateway
asks it before a prompt is rendered (from a floor on its token count, `render.bounds`) and after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tokentape.core.sampling import SamplingParams
from tokentape.errors import ContextOverflow, InvalidRequest

__all__ = ["clips_max_tokens", "fit_to_context", "overflow_from_floor", "prompt_room"]


def clips_max_tokens(gateway_clips: bool, metadata: Mapping[str, Any]) -> bool:
    """Whether a `max_tokens` beyond the room left is clipped (finish `length`) rather than refused:
    opt-in for the whole gateway (`clip_max_tokens`) or per session (metadata `max_tokens: clip`),
    and always for a harness's sessions (Claude Code asks for 128,000, opencode for 32,000)."""
    return gateway_clips or metadata.get("max_tokens") == "clip" or "harness" in metadata


def prompt_room(context: int, sampling: SamplingParams, clip: bool) -> int:
    """The most tokens a prompt may hold (`fit_to_context`'s rule, before the prompt is known)."""
    return context - 1 if clip else context - (sampling.max_tokens or 1)


def overflow_from_floor(context: int, floor: int, sampling: SamplingParams, clip: bool) -> ContextOverflow:
    """The refusal of a prompt known to hold at least `floor` tokens by the length of its text, more
    than `prompt_room` leaves: found before it was rendered whole or tokenized (`render.bounds`)."""
    wanted = "" if clip else f", and {sampling.max_tokens or 1} more to generate"
    return ContextOverflow(
        f"this model's context holds {context} tokens; the prompt holds at least {floor} by the length of its "
        f"text alone{wanted}",
        param="messages",
    )


def fit_to_context(
    prompt_tokens: int, context: int, vocab_size: int, sampling: SamplingParams, clip: bool
) -> SamplingParams:
    """`sampling` for a prompt of `prompt_tokens`: unchanged when it fits, its `max_tokens` cut to the
    room left when clipping, else a `ContextOverflow` naming what does not fit. A token id the
    sampling names outside the vocabulary is refused first."""
    outside = sampling.token_ids_outside(vocab_size)
    if outside is not None:
        field, token = outside
        raise InvalidRequest(
            f"{field} names token {token}; the model's vocabulary has {vocab_size} tokens", param=field
        )
    wanted = prompt_tokens + (sampling.max_tokens or 1)
    if clip and prompt_tokens < context and wanted > context:
        return dataclasses.replace(sampling, max_tokens=context - prompt_tokens)
    if wanted > context:
        raise ContextOverflow(
            f"this model's context holds {context} tokens; the request needs {wanted} "
            f"({prompt_tokens} in the prompt, {sampling.max_tokens or 1} to generate)",
            param="max_tokens" if prompt_tokens < context else "messages",
            prompt_tokens=prompt_tokens,
            max_tokens=sampling.max_tokens or 1,
            context_length=context,
        )
    return sampling

"""The engine seam: one async method that streams sampled tokens for a token-ID prompt."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tokentape.core.sampling import SamplingParams

__all__ = ["Constraint", "ConstraintKind", "Engine", "SampledToken"]

ConstraintKind = Literal["json_schema", "regex", "grammar"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the sampled text must match: a JSON schema (JSON text), a regular expression, or a
    grammar in llama.cpp's GBNF. The engine masks every token that would leave it, so the recorded
    logprobs are those of the constrained distribution."""

    kind: ConstraintKind
    value: str


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float  # log p(token) under logits / temperature, before truncation (greedy: temperature 1)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # most likely tokens at this position, best first


class Engine(Protocol):
    """Generates one choice at a time. Closing the iterator early aborts the generation."""

    @property
    def model_id(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    @property
    def constraint_kinds(self) -> frozenset[ConstraintKind]:
        """The kinds of `Constraint` this engine enforces; the gateway refuses the others."""
        ...

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncGenerator[SampledToken, None]:
        """Stream sampled tokens. Stops after an end-of-turn token or one of `params.stop_token_ids`
        (included in the stream), after `params.max_tokens`, or at the end of the context. With a
        `constraint`, only tokens that keep the text inside it are sampled."""
        ...

    def describe(self) -> dict[str, Any]:
        """The engine's own account of itself for status pages: at least `kind` and `tokens_generated`."""
        ...

    async def close(self) -> None: ...

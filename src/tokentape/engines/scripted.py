"""A scripted engine: an instrument for tests and benchmarks that must exclude real inference.

It answers instantly, logprob -1.0 per token: with the next queued script if there is one (exactly
those tokens; `together`: marked as come together, as a remote engine's events read at once are),
else with its fixed script followed by the end-of-turn token. It constrains nothing:
a constrained request is refused as an engine without constrained decoding refuses it. Never used by
`tokentape serve`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken
from tokentape.errors import InvalidRequest

__all__ = ["ScriptedEngine"]


class ScriptedEngine:
    def __init__(self, script: Sequence[int], end_of_turn: int, *, context_length: int = 1 << 20) -> None:
        self.script = list(script)
        self.end_of_turn = end_of_turn
        self.queue: deque[tuple[list[int], bool]] = deque()
        self.model_id = "scripted"
        self.context_length = context_length
        self.calls = 0
        self.tokens = 0

    def push(self, tokens: Sequence[int], *, together: bool = False) -> None:
        """Answer the next generation with exactly `tokens` (cut by max_tokens); `together`: each but
        the last marked as followed by another (`SampledToken.follows`)."""
        self.queue.append((list(tokens), together))

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
    ) -> AsyncGenerator[SampledToken, None]:
        if constraint is not None:  # it plays an engine without constrained decoding
            raise InvalidRequest("the scripted engine cannot constrain its output", param="response_format")
        self.calls += 1
        tokens, together = self.queue.popleft() if self.queue else ([*self.script, self.end_of_turn], False)
        if params.max_tokens is not None:
            tokens = tokens[: params.max_tokens]
        for index, token in enumerate(tokens):
            self.tokens += 1
            yield SampledToken(token, -1.0, follows=together and index + 1 < len(tokens))

    def describe(self) -> dict[str, Any]:
        return {"kind": "scripted", "model": self.model_id, "calls": self.calls, "tokens_generated": self.tokens}

    async def close(self) -> None:
        return None

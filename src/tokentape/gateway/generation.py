"""One choice of one request: stream the engine's tokens as text deltas, cut stop strings, split the
text into reasoning, content and tool calls, and say how the generation ended.

Recording is the caller's (the service attaches the turn and writes it); this module only keeps
every sampled token, including those of a generation cut short, so nothing sampled is lost. A
generation the engine failed is marked (`engine_fault`): its tokens are not recorded.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from tokentape.core.reply import ParsedReply, ReplyStream, ToolFormat
from tokentape.core.sampling import SamplingParams
from tokentape.core.tape import FinishReason
from tokentape.core.text import StopStringFilter, TextAssembler
from tokentape.engines.base import Constraint, Engine, SampledToken
from tokentape.errors import EngineFailure
from tokentape.gateway.calls import TextDelta
from tokentape.render.tokenizer import Tokenizer

__all__ = ["ENGINE_ATTEMPTS", "ChoiceRun", "ReplyMode"]

ENGINE_ATTEMPTS = 2  # an engine error before the first token is retried once


@dataclass(frozen=True, slots=True)
class ReplyMode:
    """How a chat reply's text is split into reasoning, content and tool calls."""

    tool_format: ToolFormat
    reasoning: bool
    starts_inside: bool


class ChoiceRun:
    """The state of one generation; `stream()` yields its deltas, the attributes hold the result."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        index: int,
        prompt: Sequence[int],
        sampling: SamplingParams,
        *,
        mode: ReplyMode | None,
        stop_ids: frozenset[int],
        session_id: str,
        interrupted: Callable[[], bool],
        on_engine_call: Callable[[], None],
        constraint: Constraint | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.index = engine, tokenizer, index
        self.prompt, self.sampling, self.mode = prompt, sampling, mode
        self.stop_ids = stop_ids | frozenset(sampling.stop_token_ids)
        self.session_id = session_id
        self._interrupted = interrupted
        self._on_engine_call = on_engine_call
        self.constraint = constraint
        self.tokens: list[SampledToken] = []
        self.text_parts: list[str] = []
        self.finish: FinishReason = "abort"
        self.completed = False
        self.engine_fault = False  # the engine failed: what it sent is not recorded
        self.reply = ParsedReply("", None)
        # monotonic times: the last engine call, its first and its latest token (for metrics)
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._pending: list[SampledToken] = []
        self._assembler = TextAssembler()
        self._stops = StopStringFilter(sampling.stop)
        self._splitter = (
            ReplyStream(mode.tool_format, reasoning=mode.reasoning, starts_inside=mode.starts_inside) if mode else None
        )

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def partial_reply(self) -> ParsedReply:
        """What a generation cut short had said (its text, unparsed)."""
        return self.reply if self.completed else ParsedReply(self.text, None)

    def _delta(self, text: str, final: bool = False) -> TextDelta | None:
        self.text_parts.append(text)
        parts = [("content", text)] if self._splitter is None else self._splitter.feed(text)
        if final and self._splitter is not None:
            parts += self._splitter.finish()
        content = "".join(t for kind, t in parts if kind == "content")
        reasoning = "".join(t for kind, t in parts if kind == "reasoning")
        if not (content or reasoning or (final and self._pending)):
            return None
        event = TextDelta(self.index, content, self._pending, reasoning)
        self._pending = []
        return event

    async def stream(self) -> AsyncIterator[TextDelta]:
        interrupted = False
        for attempt in range(ENGINE_ATTEMPTS):
            try:
                self._on_engine_call()
                self.started_at = time.monotonic()
                # the constraint is passed only when there is one: engines written before it need not take it
                extra = {"constraint": self.constraint} if self.constraint is not None else {}
                generation = self.engine.generate(
                    self.prompt,
                    self.sampling,
                    seed=self.sampling.choice_seed(self.index),
                    session_id=self.session_id,
                    **extra,
                )
                async with contextlib.aclosing(generation):
                    async for sample in generation:
                        self.last_token_at = time.monotonic()
                        self.first_token_at = self.first_token_at or self.last_token_at
                        self.tokens.append(sample)
                        self._pending.append(sample)
                        piece = self.tokenizer.token_bytes(sample.token_id)
                        if (event := self._delta(self._stops.feed(self._assembler.feed(piece)))) is not None:
                            yield event
                        if self._stops.stopped or sample.token_id in self.stop_ids:
                            self.finish = "stop"
                            break
                        if self._interrupted():  # paused with abort: the weights are changing
                            interrupted = True
                            break
                break
            except EngineFailure:
                # before the first token a retry is invisible; after it, it would duplicate the turn
                if self.tokens or attempt + 1 == ENGINE_ATTEMPTS:
                    self.engine_fault = True
                    raise
        if self.finish != "stop":
            self.finish = "abort" if interrupted else "length"
        if (event := self._delta(self._stops.feed(self._assembler.finish()) + self._stops.finish(), True)) is not None:
            yield event
        # the stream's own parse of the whole text: the streamed deltas add up to exactly this reply
        parsed = self._splitter.parsed if self._splitter is not None else None
        self.reply = parsed if parsed is not None else ParsedReply(self.text, None)
        if self.reply.tool_calls and self.finish == "stop":
            self.finish = "tool_calls"
        self.completed = True

"""One choice of one request: stream the engine's tokens as text deltas, cut stop strings, split the
text into reasoning, content and tool calls, and say how the generation ended.

Recording is the caller's (the service attaches the turn and writes it); this module only keeps
every sampled token, including those of a generation cut short, so nothing sampled is lost. A
generation the engine failed is marked (`engine_fault`): its tokens are not recorded.

A caller that reads only the result (the client did not ask for a stream) gets one delta at the end
instead of one per token, and when no stop string has to be watched token by token the engine is
asked for the whole answer in one piece: one upstream answer instead of an event per token, for the
engine as for the gateway. A weight update that stops running generations (pause with abort) cuts
them at their next token; such a generation, though, has nothing until its answer is complete, so
while nothing has come it is withdrawn instead: nothing is recorded, and the caller runs it again once
generation resumes, streamed from the engine this time, so that a second update cuts it at its next
token like any other (no request waits through update after update).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
        streamed: bool = True,
        may_fetch_whole: bool = True,
        awaiting_whole: set[ChoiceRun] | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.index = engine, tokenizer, index
        self.prompt, self.sampling, self.mode = prompt, sampling, mode
        self.stop_ids = stop_ids | frozenset(sampling.stop_token_ids)
        # the engine is told every token that ends the turn, so it stops there itself
        self._engine_sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sorted(self.stop_ids)))
        self.streamed = streamed  # False: the caller reads only the result
        self.whole = may_fetch_whole and not streamed and not sampling.stop  # the engine may answer in one piece
        self._awaiting_whole = awaiting_whole if awaiting_whole is not None else set()
        self._task: asyncio.Task[Any] | None = None
        self._withdrawing = False
        self.withdrawn = False  # stopped before anything came: nothing to record, to be run again
        self._interrupted_here = False
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

    def withdraw(self) -> None:
        """Stop a generation that is waiting for its whole answer (its task is cancelled; `stream`
        ends with `withdrawn` set unless the task was also cancelled for another reason)."""
        if self._task is not None and not self._withdrawing:
            self._withdrawing = True
            self._task.cancel()

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
        held: list[str] = []  # the text so far, for a caller that reads only the result
        for attempt in range(ENGINE_ATTEMPTS):
            try:
                self._on_engine_call()
                self.started_at = time.monotonic()
                generation = self.engine.generate(
                    self.prompt,
                    self._engine_sampling,
                    seed=self.sampling.choice_seed(self.index),
                    session_id=self.session_id,
                    constraint=self.constraint,
                    whole=self.whole,
                )
                async with contextlib.aclosing(generation):
                    self._withdrawable(self.whole)
                    try:
                        async for sample in generation:
                            self._withdrawable(False)  # something came: from here it can only be cut
                            text = self._accept(sample)
                            if not self.streamed:
                                held.append(text)
                            elif (event := self._delta(text)) is not None:
                                yield event
                            if self._ends_here(sample):
                                break
                    except asyncio.CancelledError:
                        if not self._took_back_withdrawal():
                            raise
                        return
                    finally:
                        self._withdrawable(False)
                break
            except EngineFailure:
                # before the first token a retry is invisible; after it, it would duplicate the turn
                if self.tokens or attempt + 1 == ENGINE_ATTEMPTS:
                    self.engine_fault = True
                    raise
        if self.finish != "stop":
            self.finish = "abort" if self._interrupted_here else "length"
        tail = self._stops.feed(self._assembler.finish()) + self._stops.finish()
        if (event := self._delta("".join(held) + tail, True)) is not None:
            yield event
        # the stream's own parse of the whole text: the streamed deltas add up to exactly this reply
        parsed = self._splitter.parsed if self._splitter is not None else None
        self.reply = parsed if parsed is not None else ParsedReply(self.text, None)
        if self.reply.tool_calls and self.finish == "stop":
            self.finish = "tool_calls"
        self.completed = True

    def _accept(self, sample: SampledToken) -> str:
        """Keep a sampled token; its text (held back where UTF-8 or a stop string is undecided)."""
        self.last_token_at = time.monotonic()
        if self.streamed:  # a time to first token is what a client that streams waits for
            self.first_token_at = self.first_token_at or self.last_token_at
        self.tokens.append(sample)
        self._pending.append(sample)
        return self._stops.feed(self._assembler.feed(self.tokenizer.token_bytes(sample.token_id)))

    def _ends_here(self, sample: SampledToken) -> bool:
        if self._stops.stopped or sample.token_id in self.stop_ids:
            self.finish = "stop"
            return True
        if self._interrupted():  # paused with abort: the weights are changing
            self._interrupted_here = True
            return True
        return False

    def _withdrawable(self, waiting: bool) -> None:
        """Whether a weight update may withdraw this generation now (it waits for its first token)."""
        if waiting:
            self._task = asyncio.current_task()
            self._awaiting_whole.add(self)
        elif self._task is not None:
            self._awaiting_whole.discard(self)
            self._task = None

    def _took_back_withdrawal(self) -> bool:
        """On a cancellation: whether it was the withdrawal alone (then it is taken back and the
        generation marked withdrawn); a client that left cancels too, and that one stands."""
        task = asyncio.current_task()
        if not self._withdrawing or self.tokens or task is None or task.cancelling() > 1:
            return False
        task.uncancel()
        self.withdrawn = True
        return True

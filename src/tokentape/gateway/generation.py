"""One choice of one request: stream the engine's tokens as text deltas, cut stop strings, split the
text into reasoning, content and tool calls, and say how the generation ended.

Recording is the caller's (the service attaches the turn and writes it); this module only keeps
every sampled token, including those of a generation cut short, so nothing sampled is lost. A
generation the engine failed is marked (`engine_fault`): its tokens are not recorded.

A caller that reads only the result (the client did not ask for a stream) gets one delta at the end
instead of one per token, and when no stop string has to be watched token by token the engine is
asked for the whole answer in one piece: one upstream answer instead of an event per token, for the
engine as for the gateway. Streamed, tokens that came together from the engine (`SampledToken.follows`:
one event, or events read at once, as when the gateway falls behind) make one delta: what is sent
never waits for a token that has not come.

Weight updates (`gateway.versions`): a generation runs in segments, each pinned to one weights
version when it is dispatched. An update that lets turns go on (continue, keep) stops the segment at
a token boundary (or at once while it waits for the engine's next token); once the new weights are
in, the next segment generates on from the prompt plus every token sampled so far, with what is left
of max_tokens, through the same stop-string filter and text assembly: one turn, one reply, no token
lost or doubled. Each segment's tokens become one policy span (one per version, where the engine
names the version of each token it sampled, as verl's servers do). A constrained generation that has
sampled is the exception: the engine's grammar cannot start again mid-output, so it runs to its end
under the version it began with, and the update waits for it. An update that aborts ends a streamed
generation at its next token (finish reason abort); one waiting for its whole answer has shown
nothing, so it goes on after the update instead, streamed from the engine this time, so that a
second update cuts it at its next token like any other.
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
from tokentape.core.versions import PolicySpan, add_span
from tokentape.engines.base import Constraint, Engine, PromptImage, SampledToken
from tokentape.errors import EngineFailure
from tokentape.gateway.calls import TextDelta
from tokentape.gateway.versions import Pin, VersionGate
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
        gate: VersionGate,
        on_engine_call: Callable[[], None],
        constraint: Constraint | None = None,
        streamed: bool = True,
        images: Sequence[PromptImage] = (),
    ) -> None:
        self.engine, self.tokenizer, self.index = engine, tokenizer, index
        # the prompt's images: given to the engine only when there are some (`base.takes_images`)
        self._engine_options: dict[str, Any] = {"images": images} if images else {}
        self.prompt, self.sampling, self.mode = prompt, sampling, mode
        self.stop_ids = stop_ids | frozenset(sampling.stop_token_ids)
        # the engine is told every token that ends the turn, so it stops there itself
        self._engine_sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sorted(self.stop_ids)))
        self.streamed = streamed  # False: the caller reads only the result
        self.whole = not streamed and not sampling.stop  # the engine may answer in one piece
        self.waiting_whole = False  # waiting for an answer in one piece: nothing has come yet
        self._task: asyncio.Task[Any] | None = None
        self._cutting = False
        self._interrupted_here = False
        self.session_id = session_id
        self.gate = gate
        self._on_engine_call = on_engine_call
        # weights: the spans of versions over the sampled tokens, and the label of the turn
        self.spans: list[PolicySpan] = []
        self.label: str | None = None
        self.pin: Pin | None = None  # the first segment's
        self._seamed = False  # the current segment stopped at a seam: the turn goes on
        self._kv_from: int | None = None  # under keep: the oldest version of the KV the next segment runs on
        self._span_start = 0
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

    def cut(self) -> None:
        """Stop the segment waiting for the engine's next token now (its task is cancelled; the
        cancellation is taken back, unless the task was also cancelled for another reason)."""
        if not self._seamable():
            return
        if self._task is not None and not self._cutting:
            self._cutting = True
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
        # the text so far, for a caller that reads only the result; streamed, what came with a token still to read
        held: list[str] = []
        stopped_at: float | None = None  # when the last segment stopped at a seam
        while True:
            pin = await self.gate.enter()
            if self.pin is None:
                self.pin = pin
            if stopped_at is not None:
                self.gate.seam_waits.append(time.monotonic() - stopped_at)
            try:
                async for delta in self._segment(pin, held):
                    yield delta
            finally:
                self.gate.leave()
                self._close_span(pin)
            if not self._seamed:
                break
            stopped_at = time.monotonic()
            self._seamed = False
            self.whole = False  # after a seam, streamed from the engine: the next update cuts it at a token
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

    def _close_span(self, pin: Pin) -> None:
        end = len(self.tokens)
        if end > self._span_start:
            if not self.spans:
                self.label = pin.label
            start, version = self._span_start, self._version_of(self._span_start, pin)
            for i in range(start + 1, end):  # one span per run of tokens under one version
                if (own := self._version_of(i, pin)) != version:
                    add_span(self.spans, version, start, i, self._kv_from)
                    start, version = i, own
            add_span(self.spans, version, start, end, self._kv_from)
        elif not self.spans:
            self.label = pin.label  # nothing sampled yet: the latest dispatch's
        self._span_start = end
        if self._seamed:
            last = self.spans[-1] if self.spans else None
            if self.gate.seam_mode == "keep" and last is not None:
                self._kv_from = last.kv_version if last.kv_version is not None else last.version
            elif self.gate.seam_mode != "keep":
                self._kv_from = None

    def _version_of(self, index: int, pin: Pin) -> int:
        """The version that sampled token `index`: the engine's word where it gives one, else the pin's."""
        own = self.tokens[index].version
        return pin.version if own is None else own

    async def _segment(self, pin: Pin, held: list[str]) -> AsyncIterator[TextDelta]:
        """One engine generation under one pinned version, from the prompt plus what was sampled."""
        prompt, sampling = self.prompt, self._engine_sampling
        if self.tokens:
            prompt = [*self.prompt, *(t.token_id for t in self.tokens)]
            if sampling.max_tokens is not None:
                sampling = dataclasses.replace(sampling, max_tokens=sampling.max_tokens - len(self.tokens))
        for attempt in range(ENGINE_ATTEMPTS):
            got = 0
            try:
                self._on_engine_call()
                self.started_at = time.monotonic()
                generation = self.engine.generate(
                    prompt,
                    sampling,
                    seed=self.sampling.choice_seed(self.index),
                    session_id=self.session_id,
                    constraint=self.constraint,
                    whole=self.whole,
                    **self._engine_options,
                )
                async with contextlib.aclosing(generation):
                    # Unstreamed, the loop awaits nothing but the engine's next token: the run is at the
                    # engine from its first wait to its last, marked once per segment instead of twice a
                    # token. Streamed, it also waits on its reader between tokens, where no cut belongs.
                    whole_loop = not self.streamed
                    if whole_loop:
                        self._at_engine(True)
                    try:
                        while True:
                            if not whole_loop:
                                self._at_engine(True)
                            try:
                                sample = await anext(generation)
                            except StopAsyncIteration:
                                break
                            except asyncio.CancelledError:
                                if not self._took_back_cut():
                                    raise
                                # cut while waiting: nothing of this token came. At max_tokens (or the end
                                # of the context) it was only waiting for the engine to end: it is over.
                                self._seamed = self._room_left()
                                return
                            finally:
                                if not whole_loop:
                                    self._at_engine(False)
                            got += 1
                            self.waiting_whole = False  # something came: it no longer waits for it all
                            text = self._accept(sample)
                            if not self.streamed:
                                held.append(text)
                            elif sample.follows and not self._ends_here(sample, pin):
                                held.append(text)  # its text goes with the next token's, which came with it
                            else:
                                if held:
                                    text = "".join(held) + text
                                    held.clear()
                                if (event := self._delta(text)) is not None:
                                    yield event
                            if self._ends_here(sample, pin):
                                break
                    finally:
                        if whole_loop:
                            self._at_engine(False)
                break
            except EngineFailure:
                # before the segment's first token a retry is invisible; after it, it would duplicate tokens
                if got or attempt + 1 == ENGINE_ATTEMPTS:
                    self.engine_fault = True
                    raise

    def _accept(self, sample: SampledToken) -> str:
        """Keep a sampled token; its text (held back where UTF-8 or a stop string is undecided)."""
        self.last_token_at = time.monotonic()
        if self.streamed:  # a time to first token is what a client that streams waits for
            self.first_token_at = self.first_token_at or self.last_token_at
        self.tokens.append(sample)
        self._pending.append(sample)
        return self._stops.feed(self._assembler.feed(self.tokenizer.token_bytes(sample.token_id)))

    def _ends_here(self, sample: SampledToken, pin: Pin) -> bool:
        if self._stops.stopped or sample.token_id in self.stop_ids:
            self.finish = "stop"
            return True
        if self.gate.abort_epoch != pin.abort_epoch:  # paused with abort: the weights are changing
            self._interrupted_here = True
            return True
        if self.gate.seam_epoch != pin.seam_epoch and self._room_left() and self._seamable():
            self._seamed = True  # the weights are changing: it goes on once they are in
            return True
        return False

    def _seamable(self) -> bool:
        """Whether the turn may stop at a seam and go on: not once a constrained one has sampled, since
        the engine's grammar would start again at its root after those tokens; such a turn ends under
        the version it began with (the update waits for it)."""
        return self.constraint is None or not self.tokens

    def _room_left(self) -> bool:
        """Whether the turn would sample again (not at max_tokens nor at the end of the context)."""
        count = len(self.tokens)
        if self.sampling.max_tokens is not None and count >= self.sampling.max_tokens:
            return False
        return len(self.prompt) + count < self.engine.context_length

    def _at_engine(self, waiting: bool) -> None:
        """Whether an update may cut this generation now (it waits for the engine's next token)."""
        if waiting:
            self._task = asyncio.current_task()
            self.waiting_whole = self.whole and not self.tokens
            self.gate.at_engine.add(self)
        else:
            self.gate.at_engine.discard(self)
            self._task = None
            self.waiting_whole = False

    def _took_back_cut(self) -> bool:
        """On a cancellation: whether it was the cut alone (then it is taken back); a client that left
        cancels too, and that one stands."""
        task = asyncio.current_task()
        cutting, self._cutting = self._cutting, False
        if not cutting or task is None or task.cancelling() > 1:
            return False
        task.uncancel()
        return True

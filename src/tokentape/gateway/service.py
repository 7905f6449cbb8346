"""One request, one turn per choice: find the request's place in its session, build the prompt
from the tape (never from re-rendered history), generate, and record every sampled token.

Bad input raises before anything is recorded. A generation cut short (the caller went away) is
still recorded, with finish reason "abort", so no sampled token is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.messages import EMPTY_CHAIN, Message, chain_step, hash_chain
from tokentape.core.reply import ParsedReply, ReplyStream, ToolFormat, parse_reply
from tokentape.core.sampling import SamplingParams
from tokentape.core.session import Extend, Fresh, NewTurn, plan_request
from tokentape.core.tape import FinishReason, Origin, Rewrite, RewritePolicy, TurnNode, path_tokens
from tokentape.core.text import StopStringFilter, TextAssembler
from tokentape.engines.base import Engine, SampledToken
from tokentape.errors import Conflict, ContextOverflow, EngineFailure, InvalidRequest, Overloaded
from tokentape.gateway.sessions import Session, SessionRegistry
from tokentape.render.renderer import Renderer, RenderOptions

ENGINE_ATTEMPTS = 2  # an engine error before the first token is retried once

__all__ = ["Gateway", "ChatCall", "CompletionCall", "Started", "TextDelta", "ChoiceDone", "Event"]


@dataclass(frozen=True, slots=True)
class ChatCall:
    messages: Sequence[Message]
    sampling: SamplingParams
    options: RenderOptions = dataclasses.field(default_factory=RenderOptions)
    session_id: str | None = None
    rewrite_policy: RewritePolicy | None = None
    parse_tool_calls: bool = False  # tools were offered and tool_choice is not "none"
    request_key: bytes | None = None  # names this request's body, for SDK retries
    retry: bool = False  # an SDK retry (x-stainless-retry-count > 0): replay, never sample again


@dataclass(frozen=True, slots=True)
class CompletionCall:
    prompt: str | Sequence[int]
    sampling: SamplingParams
    session_id: str | None = None
    echo: bool = False
    request_key: bytes | None = None
    retry: bool = False


@dataclass(frozen=True, slots=True)
class Started:
    session_id: str
    prompt_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class TextDelta:
    index: int
    text: str  # content (chat) or text (completions)
    tokens: list[SampledToken]
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class ChoiceDone:
    index: int
    reply: ParsedReply  # for completions: the raw text as content
    text: str  # the generated text, stop strings cut
    tokens: list[SampledToken]
    finish_reason: FinishReason
    turn_id: int


@dataclass(frozen=True, slots=True)
class ReplyMode:
    """How a chat reply's text is split into reasoning, content and tool calls."""

    tool_format: ToolFormat
    reasoning: bool
    starts_inside: bool


Event = Started | TextDelta | ChoiceDone


@dataclass(frozen=True, slots=True)
class _Plan:
    session: Session
    turn: NewTurn
    prompt: list[int]
    prompt_chain: bytes  # chain hash of the request's messages
    prompt_length: int  # how many messages the request had
    reply_mode: ReplyMode | None = None  # None: raw completion text
    request_key: bytes | None = None


class Gateway:
    def __init__(self, engine: Engine, renderer: Renderer, sessions: SessionRegistry, *, max_waiting: int = 64) -> None:
        self.engine = engine
        self.renderer = renderer
        self.sessions = sessions
        self.max_waiting = max_waiting  # requests admitted at once; more get 429 with Retry-After
        self.active = 0
        self.engine_calls = 0
        self._end_of_turn = renderer.tokenizer.end_of_turn_ids
        self.policy_version: str | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._abort_epoch = 0  # bumped by pause(abort=True): generations started before it stop

    # -- weight updates --------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self, *, abort: bool) -> None:
        """Hold new generations (their requests wait, they are not rejected); with `abort`, also stop
        the running ones at their next token (recorded with finish reason "abort")."""
        self._running.clear()
        if abort:
            self._abort_epoch += 1

    def resume(self, policy_version: str | None) -> None:
        """Release held generations; what they sample is recorded under `policy_version`."""
        if policy_version is not None:
            self.policy_version = policy_version
        self._running.set()

    # -- chat ------------------------------------------------------------------------------------
    async def chat(self, call: ChatCall) -> AsyncIterator[Event]:
        """Stream the events of one chat request; every choice is recorded as a turn."""

        async def plan(session: Session) -> _Plan:
            return await self._plan_chat(session, call)

        async for event in self._serve(
            call.session_id, call.rewrite_policy, call.request_key, call.retry, call.sampling, plan
        ):
            yield event

    async def _serve(
        self,
        session_id: str | None,
        policy: RewritePolicy | None,
        key: bytes | None,
        retry: bool,
        sampling: SamplingParams,
        plan: Callable[[Session], Awaitable[_Plan]],
    ) -> AsyncIterator[Event]:
        """One request's life: replay it if it is a retry; else claim it, plan it within an admission
        slot, run it, and release the claim when it is done."""
        with self._session_for(session_id, policy, key) as session:
            replayed = await self._replay(session, key, retry)
            if replayed is None:
                release = self._claim(session, key)
                try:
                    session.check_open()
                    with self._admission():
                        planned = dataclasses.replace(await plan(session), request_key=key)
                        self._check_room(planned.prompt, sampling)
                except BaseException:
                    release()
                    raise
                session.requests += 1
        if replayed is not None:
            for event in replayed:
                yield event
            return
        try:
            async for event in self._run(planned, sampling):
                yield event
        finally:
            release()

    async def _plan_chat(self, session: Session, call: ChatCall) -> _Plan:
        tree = session.tree
        if not call.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        chains = list(hash_chain(call.messages))
        decision = plan_request(tree, call.messages, chains)
        if decision.rewrite is not None and tree.policy == "strict":
            raise Conflict(_strict_message(decision.rewrite), param="messages", code="rewrite_rejected")
        if isinstance(decision, Extend):
            node = decision.node
            bridge = await asyncio.to_thread(
                self.renderer.bridge,
                call.messages,
                decision.new_from - 1,
                node.reply,
                self._stop_token(node),
                call.options,
            )
            rewrite = decision.rewrite
            if bridge.template_rewrite:
                rewrite = Rewrite(
                    kind="template",
                    policy=tree.policy,
                    at_message=decision.new_from - 1,
                    at_token=None,
                    detail="the chat template renders an earlier reply differently once new messages follow",
                )
                if tree.policy == "strict":
                    raise Conflict(_strict_message(rewrite), param="messages", code="rewrite_rejected")
                if tree.policy == "fork":
                    return await self._plan_fresh(session, call, Fresh(node, rewrite), chains[-1])
            turn = NewTurn(node, node.end, tuple(bridge.tokens), Origin.BRIDGE, rewrite)
            mode = self._reply_mode(call, bridge.opens_reasoning)
            return _Plan(session, turn, path_tokens(node) + bridge.tokens, chains[-1], len(chains), mode)
        return await self._plan_fresh(session, call, decision, chains[-1])

    async def _plan_fresh(self, session: Session, call: ChatCall, decision: Fresh, chain: bytes) -> _Plan:
        prompt = await asyncio.to_thread(self.renderer.prompt, call.messages, call.options)
        tokens, count = prompt.tokens, len(call.messages)
        mode = self._reply_mode(call, prompt.opens_reasoning)
        if decision.fork_from is None:
            return _Plan(session, NewTurn(None, 0, tuple(tokens), Origin.PROMPT, None), tokens, chain, count, mode)
        parent, shared = session.tree.fork_point(decision.fork_from, tokens)
        rewrite = decision.rewrite
        if rewrite is not None:
            rewrite = dataclasses.replace(rewrite, at_token=shared)
        turn = NewTurn(parent, shared, tuple(tokens[shared:]), Origin.PROMPT, rewrite)
        return _Plan(session, turn, tokens, chain, count, mode)

    def _reply_mode(self, call: ChatCall, opens_reasoning: bool) -> ReplyMode:
        tool_format: ToolFormat = self.renderer.tool_format if call.parse_tool_calls else "none"
        return ReplyMode(tool_format, self.renderer.reasoning, opens_reasoning)

    def _stop_token(self, node: TurnNode) -> int | None:
        """The end-of-turn token a turn ended on, if it ended on one."""
        if node.sampled and node.sampled[-1] in self._end_of_turn:
            return node.sampled[-1]
        return None

    # -- completions -------------------------------------------------------------------------------
    async def complete(self, call: CompletionCall) -> AsyncIterator[Event]:
        """A raw completion; inside a session it extends the branch its token prompt starts with."""
        if isinstance(call.prompt, str):
            prompt = await asyncio.to_thread(self.renderer.tokenizer.encode, call.prompt)
        else:
            prompt = list(call.prompt)
            vocab = self.renderer.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise InvalidRequest(f"prompt token IDs must be between 0 and {vocab - 1}", param="prompt")
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")

        async def plan(session: Session) -> _Plan:
            parent = _deepest_prefix_node(session.tree.nodes, prompt)
            keep = parent.end if parent is not None else 0
            turn = NewTurn(parent, keep, tuple(prompt[keep:]), Origin.PROMPT, None)
            # Token prompts have no message history; a placeholder chain keeps them out of chat matching.
            chain = chain_step(EMPTY_CHAIN, {"role": "_completion", "content": prompt})
            return _Plan(session, turn, prompt, chain, 1)

        async for event in self._serve(call.session_id, None, call.request_key, call.retry, call.sampling, plan):
            yield event

    # -- retries ---------------------------------------------------------------------------------------
    async def _replay(self, session: Session, key: bytes | None, retry: bool) -> list[Event] | None:
        """An SDK retry of a request already answered (or still running): its recorded turns, again.

        One request, one turn per choice: a retry never samples again.
        """
        if key is None or not retry:
            return None
        first_attempt = session.pending.get(key)
        if first_attempt is not None:
            await asyncio.shield(first_attempt)
        nodes = [n for n in session.tree.turns_for_request(key) if n.finish_reason != "abort"]
        if not nodes:
            return None
        events: list[Event] = [Started(session.id, path_tokens(nodes[0])[: nodes[0].sampled_start])]
        for index, node in enumerate(nodes):
            reply = ParsedReply(
                str(node.reply.get("content") or ""),
                node.reply.get("reasoning_content"),
                list(node.reply.get("tool_calls") or []),
            )
            tokens = [SampledToken(t, lp) for t, lp in zip(node.sampled, node.logprobs, strict=True)]
            events.append(TextDelta(index, reply.content, tokens, reply.reasoning or ""))
            events.append(ChoiceDone(index, reply, reply.content, tokens, node.finish_reason, node.id))
        return events

    @staticmethod
    def _claim(session: Session, key: bytes | None) -> Callable[[], None]:
        """Mark a request as running from its first moment, so a retry arriving during planning
        waits for it instead of sampling again. Returns the release to call when it is done."""
        if key is None or key in session.pending:
            return lambda: None
        running: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        session.pending[key] = running

        def release() -> None:
            if session.pending.get(key) is running:
                del session.pending[key]
            if not running.done():
                running.set_result(None)

        return release

    @contextlib.contextmanager
    def _admission(self) -> Iterator[None]:
        """Take a slot before any work, so a burst cannot all pass the check at once; the slot is
        handed to `_run` on success and given back if planning fails."""
        if self.active >= self.max_waiting:
            raise Overloaded(
                f"{self.active} requests are already waiting for the engine; retry shortly", retry_after=1.0
            )
        self.active += 1
        try:
            yield
        except BaseException:
            self.active -= 1
            raise

    # -- shared --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _session_for(
        self, session_id: str | None, policy: RewritePolicy | None, request_key: bytes | None = None
    ) -> Any:
        """Open a session for one request; a session the request created is dropped if it fails."""
        existed = session_id is not None and self.sessions.exists(session_id)
        session = self.sessions.open(session_id, policy)
        if session_id is None and request_key is not None:
            self.sessions.remember_unnamed(request_key, session.id)
        try:
            yield session
        except BaseException:
            if not existed and not session.tree.nodes and session.requests == 0:
                self.sessions.discard(session.id)
            raise

    def _check_room(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        context = self.engine.context_length
        wanted = len(prompt) + (sampling.max_tokens or 1)
        if wanted > context:
            raise ContextOverflow(
                f"this model's context holds {context} tokens; the request needs {wanted} "
                f"({len(prompt)} in the prompt, {sampling.max_tokens or 1} to generate)",
                param="max_tokens" if len(prompt) < context else "messages",
            )

    async def _run(self, plan: _Plan, sampling: SamplingParams) -> AsyncIterator[Event]:
        session = plan.session
        session.in_flight += 1  # the admission slot taken in planning is released below
        try:
            yield Started(session.id, plan.prompt)
            for index in range(sampling.n):
                async for event in self._choice(plan, sampling, index):
                    yield event
        finally:
            session.in_flight -= 1
            self.active -= 1

    async def _choice(self, plan: _Plan, sampling: SamplingParams, index: int) -> AsyncIterator[Event]:
        tokens: list[SampledToken] = []
        pending: list[SampledToken] = []
        text_parts: list[str] = []
        assembler = TextAssembler()
        stops = StopStringFilter(sampling.stop)
        mode = plan.reply_mode
        splitter = (
            ReplyStream(mode.tool_format, reasoning=mode.reasoning, starts_inside=mode.starts_inside) if mode else None
        )
        finish: FinishReason = "abort"
        completed = False
        reply = ParsedReply("", None)
        stop_ids = self._end_of_turn | frozenset(sampling.stop_token_ids)

        def delta(text: str, final: bool = False) -> TextDelta | None:
            nonlocal pending
            text_parts.append(text)
            parts = [("content", text)] if splitter is None else splitter.feed(text)
            if final and splitter is not None:
                parts += splitter.finish()
            content = "".join(t for kind, t in parts if kind == "content")
            reasoning = "".join(t for kind, t in parts if kind == "reasoning")
            if not (content or reasoning or (final and pending)):
                return None
            event = TextDelta(index, content, pending, reasoning)
            pending = []
            return event

        await self._running.wait()  # a weight update is in progress: wait, do not fail
        epoch, version = self._abort_epoch, self.policy_version
        interrupted = False
        try:
            for attempt in range(ENGINE_ATTEMPTS):
                try:
                    self.engine_calls += 1
                    stream = self.engine.generate(
                        plan.prompt, sampling, seed=sampling.choice_seed(index), session_id=plan.session.id
                    )
                    async with contextlib.aclosing(stream):
                        async for sample in stream:
                            tokens.append(sample)
                            pending.append(sample)
                            piece = self.renderer.tokenizer.token_bytes(sample.token_id)
                            if (event := delta(stops.feed(assembler.feed(piece)))) is not None:
                                yield event
                            if stops.stopped or sample.token_id in stop_ids:
                                finish = "stop"
                                break
                            if self._abort_epoch != epoch:  # paused with abort: the weights are changing
                                interrupted = True
                                break
                    break
                except EngineFailure:
                    # before the first token a retry is invisible; after it, it would duplicate the turn
                    if tokens or attempt + 1 == ENGINE_ATTEMPTS:
                        raise
            if finish != "stop":
                finish = "abort" if interrupted else "length"
            if (event := delta(stops.feed(assembler.finish()) + stops.finish(), final=True)) is not None:
                yield event
            text = "".join(text_parts)
            if mode is None:
                reply = ParsedReply(text, None)
            else:
                reply = parse_reply(text, mode.tool_format, reasoning=mode.reasoning, starts_inside=mode.starts_inside)
            if reply.tool_calls and finish == "stop":
                finish = "tool_calls"
            completed = True
        finally:
            # Record even a cut-short generation: every sampled token stays on the tape.
            if tokens or completed:
                if not completed:
                    reply = ParsedReply("".join(text_parts), None)
                node = plan.session.tree.attach(
                    plan.turn,
                    sampled=[t.token_id for t in tokens],
                    logprobs=[t.logprob for t in tokens],
                    finish_reason=finish,
                    prompt_chain=plan.prompt_chain,
                    prompt_length=plan.prompt_length,
                    reply=reply.message(),
                    request_key=plan.request_key,
                    policy_version=version,
                )
                if not completed:  # the caller is gone: write without waiting for it
                    self.sessions.store.save_turn_later(plan.session.tree, node, plan.request_key)
        # written before it is acknowledged: the response never gets ahead of the store
        await self.sessions.store.save_turn(plan.session.tree, node, plan.request_key)
        yield ChoiceDone(index, reply, "".join(text_parts), tokens, finish, node.id)


def _deepest_prefix_node(nodes: Sequence[TurnNode], prompt: Sequence[int]) -> TurnNode | None:
    """The most recent turn whose whole path is a prefix of `prompt`."""
    for node in reversed(nodes):
        if node.end <= len(prompt) and path_tokens(node) == list(prompt[: node.end]):
            return node
    return None


def _strict_message(rewrite: Rewrite) -> str:
    return (
        f"this session's rewrite policy is strict and the request rewrites its history at message "
        f"{rewrite.at_message}: {rewrite.detail}"
    )

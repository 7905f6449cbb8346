"""One request, one turn per choice: the gateway's request path, from a call to its events.

A request holds a `Ticket` from start to end (its session, its claim on its retry key, an admission
slot, its in-flight count), given back in one place. Its life, in order: open the session; if it is
an SDK retry, replay the recorded answer of the request it repeats; else claim, plan (`planning`),
generate each choice (`generation`), and record each choice as a turn, written to the store before
it is acknowledged.

Bad input raises before anything is recorded. A generation cut short (the caller went away) is
still recorded, with finish reason "abort", so no sampled token is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.reply import ParsedReply
from tokentape.core.sampling import SamplingParams
from tokentape.core.tape import TurnNode, path_tokens
from tokentape.engines.base import Constraint, Engine, SampledToken
from tokentape.engines.remote import make_engine
from tokentape.engines.router import Router
from tokentape.errors import ContextOverflow, InvalidRequest, Overloaded
from tokentape.gateway.calls import (
    Call,
    ChatCall,
    ChoiceDone,
    CompletionCall,
    Event,
    Started,
    TextDelta,
)
from tokentape.gateway.generation import ChoiceRun, ReplyMode
from tokentape.gateway.planning import Plan, Planner
from tokentape.gateway.sessions import Session, SessionRegistry
from tokentape.gateway.ticket import Admission, Ticket
from tokentape.metrics import GatewayMetrics
from tokentape.render.renderer import Renderer

__all__ = [
    "Gateway",
    "GatewayStats",
    "ChatCall",
    "CompletionCall",
    "Started",
    "TextDelta",
    "ChoiceDone",
    "Event",
    "ReplyMode",
]


@dataclass(frozen=True, slots=True)
class GatewayStats:
    sessions_in_memory: int
    requests_active: int  # requests admitted and not done (holding an admission slot)
    retries_waiting: int  # SDK retries waiting for the request they repeat to finish
    engine_calls: int  # generations started since the gateway started
    paused: bool
    policy_version: str | None
    engine: dict[str, Any]  # the engine's own account of itself (`describe()`)


class Gateway:
    def __init__(self, engine: Engine, renderer: Renderer, sessions: SessionRegistry, *, max_active: int = 64) -> None:
        self.engine = engine
        self.renderer = renderer
        self.sessions = sessions
        self.admission = Admission(max_active)
        self.planner = Planner(renderer)
        self.engine_calls = 0
        self.policy_version: str | None = None
        self._end_of_turn = renderer.tokenizer.end_of_turn_ids
        self._running = asyncio.Event()
        self._running.set()
        self._abort_epoch = 0  # bumped by pause(abort=True): generations started before it stop
        self._writes: set[asyncio.Task[None]] = set()  # store writes not yet finished
        self._background: set[asyncio.Task[None]] = set()  # engine drains
        self._awaiting_whole: set[ChoiceRun] = set()  # generations waiting for an answer in one piece
        self._started = False
        self.metrics = GatewayMetrics()
        self.metrics.watch(live_sessions=sessions.live, active_requests=lambda: self.admission.active)

    # -- life ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Get the engines ready (remote engines: learn their model, start health checks). Idempotent."""
        if self._started:
            return
        self._started = True
        if isinstance(self.engine, Router):
            await self.engine.start()

    async def aclose(self) -> None:
        """Finish every store write, stop the engines, close the store."""
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, *self._writes, return_exceptions=True)
        await self.engine.close()
        await self.sessions.aclose()

    def stats(self) -> GatewayStats:
        return GatewayStats(
            sessions_in_memory=len(self.sessions),
            requests_active=self.admission.active,
            retries_waiting=self.sessions.retries_waiting,
            engine_calls=self.engine_calls,
            paused=self.paused,
            policy_version=self.policy_version,
            engine=self.engine.describe(),
        )

    # -- the engine pool -----------------------------------------------------------------------------
    def _pool(self) -> Router:
        if not isinstance(self.engine, Router):
            raise InvalidRequest("this gateway runs the embedded engine; start it with --engine to manage engines")
        return self.engine

    def pool(self) -> list[dict[str, Any]]:
        """The remote engines routed to, each described."""
        engines: list[dict[str, Any]] = self._pool().describe()["engines"]
        return engines

    async def add_engine(self, spec: str) -> None:
        """Add a remote engine (`KIND=URL`) once it answers its health check."""
        pool = self._pool()
        engine = make_engine(spec)
        await engine.discover()
        await engine.check_health()
        pool.add(engine)

    def drain_engine(self, url: str) -> None:
        """Place no new work on the engine at `url` (from now on); forget it once its requests finish."""
        pool = self._pool()
        engine = pool.find(url)
        engine.draining = True
        task = asyncio.get_running_loop().create_task(pool.remove_when_drained(engine))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- weight updates --------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self, *, abort: bool) -> None:
        """Hold new generations (their requests wait, they are not rejected); with `abort`, also stop
        the running ones at their next token (recorded with finish reason "abort"). A generation
        waiting for its answer in one piece has shown nothing yet: it is withdrawn and waits too
        (runs again, streamed from the engine, once resumed)."""
        self._running.clear()
        if abort:
            self._abort_epoch += 1
            for run in list(self._awaiting_whole):
                run.withdraw()

    def resume(self, policy_version: str | None) -> None:
        """Release held generations; what they sample is recorded under `policy_version`."""
        if policy_version is not None:
            self.policy_version = policy_version
        self._running.set()

    # -- requests --------------------------------------------------------------------------------------
    def run(self, call: Call, *, streamed: bool = True) -> AsyncGenerator[Event, None]:
        """Stream the events of one request: `Started`, then per choice its deltas and `ChoiceDone`.
        `streamed=False`: the caller reads only the result; each choice then has a single delta."""
        return self.chat(call, streamed) if isinstance(call, ChatCall) else self.complete(call, streamed)

    async def chat(self, call: ChatCall, streamed: bool = True) -> AsyncGenerator[Event, None]:
        match = None
        if call.session_id is None and self.sessions.match_prefix:  # the one live session it extends, if any
            match = self.sessions.match(call.messages)
            call = dataclasses.replace(call, session_id=match.session_id)
        async for event in self._serve(call, None, streamed):
            yield dataclasses.replace(event, prefix_match=match) if match and isinstance(event, Started) else event

    async def complete(self, call: CompletionCall, streamed: bool = True) -> AsyncGenerator[Event, None]:
        prompt = await self.planner.completion_prompt(call.prompt)  # bad prompts fail before a session opens
        async for event in self._serve(call, prompt, streamed):
            yield event

    async def _serve(self, call: Call, completion_prompt: list[int] | None, streamed: bool) -> AsyncIterator[Event]:
        async with await self._ticket(call) as ticket:
            session = ticket.session
            if call.retry:
                replayed = await self._replay(ticket)
                if replayed is not None:
                    for event in replayed:
                        yield event
                    return
            try:
                ticket.claim()
            except Overloaded:
                self.metrics.overloaded()
                raise
            if completion_prompt is not None:
                plan = Planner.completion(session.tree, completion_prompt)
            else:
                assert isinstance(call, ChatCall)
                plan = await self.planner.chat(session.tree, call)
            self._check_room(plan.prompt, call.sampling)
            session.requests += 1
            constraint = call.constraint if isinstance(call, ChatCall) else None
            choices = [
                self._choice(ticket, plan, call.sampling, index, constraint, call.trace_id, streamed)
                for index in range(call.sampling.n)
            ]
            async with contextlib.aclosing(choices[0]) as first:
                # An engine refuses a constraint it cannot enforce before its first token: the first choice
                # runs to its first event before the response starts, so that refusal is the request's error.
                ahead = [await anext(first)] if constraint is not None else []
                yield Started(session.id, plan.prompt)
                for event in ahead:
                    yield event
                async for event in first:
                    yield event
            for choice in choices[1:]:
                async with contextlib.aclosing(choice):
                    async for event in choice:
                        yield event

    async def _ticket(self, call: Call) -> Ticket:
        """Open the request's session (read from the store only if it is not in memory) and hold it
        under a ticket."""
        session_id = call.session_id
        session, created = await self.sessions.open(session_id, call.rewrite_policy)
        if session_id is None and call.request_key is not None:
            self.sessions.remember_unnamed(call.request_key, session.id)
        return Ticket(
            self.sessions,
            self.admission,
            session,
            created=created,
            key=call.request_key,
            track_write=self._track_write,
            on_written=self.metrics.store_write,
        )

    def _track_write(self, write: asyncio.Task[None]) -> None:
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)

    def _check_room(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        context = self.engine.context_length
        wanted = len(prompt) + (sampling.max_tokens or 1)
        if wanted > context:
            raise ContextOverflow(
                f"this model's context holds {context} tokens; the request needs {wanted} "
                f"({len(prompt)} in the prompt, {sampling.max_tokens or 1} to generate)",
                param="max_tokens" if len(prompt) < context else "messages",
            )

    # -- retries ---------------------------------------------------------------------------------------
    async def _replay(self, ticket: Ticket) -> list[Event] | None:
        """An SDK retry of a request already answered (or still running): its recorded turns, again.

        One request, one turn per choice: a retry never samples again. Only turns that reached the
        store are replayed.
        """
        request = await ticket.first_attempt()
        if request is None:
            return None
        session = ticket.session
        nodes = [
            n
            for n in session.tree.turns_of_request(request)
            if n.finish_reason != "abort" and n.id not in session.unstored
        ]
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

    # -- one choice ------------------------------------------------------------------------------------
    async def _choice(
        self,
        ticket: Ticket,
        plan: Plan,
        sampling: SamplingParams,
        index: int,
        constraint: Constraint | None,
        trace_id: str | None,
        streamed: bool,
    ) -> AsyncGenerator[Event, None]:
        session: Session = ticket.session
        withdrawn = False
        while True:
            await self._running.wait()  # a weight update is in progress: wait, do not fail
            epoch, version = self._abort_epoch, self.policy_version
            run = ChoiceRun(
                self.engine,
                self.renderer.tokenizer,
                index,
                plan.prompt,
                sampling,
                mode=plan.reply_mode,
                stop_ids=self._end_of_turn,
                session_id=session.id,
                interrupted=functools.partial(self._aborted_since, epoch),
                on_engine_call=self._count_engine_call,
                constraint=constraint,
                streamed=streamed,
                may_fetch_whole=not withdrawn,  # once withdrawn, streamed: a second update cuts it
                awaiting_whole=self._awaiting_whole,
            )
            try:
                async for delta in run.stream():
                    yield delta
            finally:
                self._observe_generation(run)
                # Record even a cut-short generation: every sampled token stays on the tape.
                # Not what a failed engine answer sent before it failed: that is not trusted.
                if (run.tokens or run.completed) and not run.engine_fault:
                    node = self._record(ticket, plan, run, constraint, trace_id, version)
                    write = ticket.write(node)
            if not run.withdrawn:  # withdrawn: nothing came; it runs again once generation resumes
                break
            withdrawn = True
        # written before it is acknowledged: the response never gets ahead of the store
        await ticket.durable(write)
        yield ChoiceDone(index, run.reply, run.text, run.tokens, run.finish, node.id)

    def _record(
        self,
        ticket: Ticket,
        plan: Plan,
        run: ChoiceRun,
        constraint: Constraint | None,
        trace_id: str | None,
        version: str | None,
    ) -> TurnNode:
        session = ticket.session
        rewrites = len(session.tree.rewrites)
        node = session.tree.attach(
            plan.turn,
            sampled=[t.token_id for t in run.tokens],
            logprobs=[t.logprob for t in run.tokens],
            finish_reason=run.finish,
            prompt_chain=plan.prompt_chain,
            prompt_length=plan.prompt_length,
            reply=run.partial_reply().message(),
            request_key=ticket.key,
            request=ticket.request,
            trace_id=trace_id,
            policy_version=version,
            logprob_mode=run.tokens[0].logprob_mode if run.tokens else None,
            template_inputs=plan.template_inputs,
            constrained=constraint is not None,
        )
        self.metrics.turn_recorded(
            prompt_tokens=len(plan.prompt), sampled_tokens=len(run.tokens), finish_reason=run.finish
        )
        for rewrite in session.tree.rewrites[rewrites:]:
            self.metrics.rewrite(rewrite.kind)
        return node

    def _aborted_since(self, epoch: int) -> bool:
        return self._abort_epoch != epoch

    def _count_engine_call(self) -> None:
        self.engine_calls += 1

    def _observe_generation(self, run: ChoiceRun) -> None:
        if run.started_at is None or run.last_token_at is None:
            return  # no token came: nothing to time
        first = None if run.first_token_at is None else run.first_token_at - run.started_at
        self.metrics.generation(seconds=run.last_token_at - run.started_at, first_token_seconds=first)

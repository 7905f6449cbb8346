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
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.context_room import clips_max_tokens, fit_to_context, overflow_from_floor, prompt_room
from tokentape.core.episodes import episode_head, is_side_call, side_session_id
from tokentape.core.reply import ParsedReply
from tokentape.core.sampling import SamplingParams
from tokentape.core.staleness import GroupAdmission, Staleness, first_version, is_stale, session_bound
from tokentape.core.tape import TurnNode, path_tokens
from tokentape.core.token_ids import FirstPromptIds
from tokentape.core.versions import parse_version
from tokentape.engines.base import Constraint, Engine, EnginePool, PromptImage, SampledToken, takes_images
from tokentape.errors import Conflict, InvalidRequest, Overloaded
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
from tokentape.gateway.updates import PROBE_TEXT, WeightUpdater, parse_update
from tokentape.gateway.versions import VersionGate
from tokentape.metrics import GatewayMetrics
from tokentape.render.bounds import PromptTooLong
from tokentape.render.renderer import Renderer

__all__ = [
    "Gateway",
    "UpdaterFactory",
    "GatewayStats",
    "ChatCall",
    "CompletionCall",
    "Started",
    "TextDelta",
    "ChoiceDone",
    "Event",
    "ReplyMode",
]


# what runs a gateway's weight updates, made from its version gate, its engines (listed when asked:
# a pool changes) and the probe's prompt; `WeightUpdater` itself by default
UpdaterFactory = Callable[[VersionGate, Callable[[], Sequence[Engine]], Sequence[int]], WeightUpdater]


@dataclass(frozen=True, slots=True)
class GatewayStats:
    sessions_in_memory: int
    requests_active: int  # requests admitted and not done (holding an admission slot)
    retries_waiting: int  # SDK retries waiting for the request they repeat to finish
    engine_calls: int  # generations started since the gateway started
    paused: bool
    policy_version: str | None
    weights_version: int
    engine: dict[str, Any]  # the engine's own account of itself (`describe()`)


class Gateway:
    def __init__(
        self,
        engine: Engine,
        renderer: Renderer,
        sessions: SessionRegistry,
        *,
        max_active: int = 64,
        clip_max_tokens: bool = False,
        staleness: Staleness | None = None,
        version: int = 0,
        updates: UpdaterFactory = WeightUpdater,
    ) -> None:
        """Everything a gateway is given is given here; nothing is set on it afterwards. `version`: the
        weights version its engines already hold (a gateway restarted after an update); `updates`: what
        runs `POST /admin/weights` (a cluster's gateways hand it to their engine registry)."""
        self.engine = engine
        self.renderer = renderer
        self.sessions = sessions
        self.admission = Admission(max_active)
        self.planner = Planner(renderer, sessions.images.read)
        self.engine_calls = 0
        # RL clients' choice: a request whose max_tokens passes the context gets the room left (finish
        # `length`) instead of OpenAI's 400; sessions opt in alone with metadata {"max_tokens": "clip"}
        self.clip_max_tokens = clip_max_tokens
        self.gate = VersionGate()  # the weights version, and the generations running against it
        if version:
            self.gate.version, self.gate.label = version, str(version)
        self.updates = updates(self.gate, self.engines, renderer.tokenizer.encode(PROBE_TEXT))
        self.staleness = staleness = staleness or Staleness()
        self.group_admission: GroupAdmission | None = None
        if staleness.admit_per_version is not None:
            self.group_admission = GroupAdmission(staleness.max_staleness or 0, staleness.admit_per_version)
        self.admission_retry_after = 5.0
        self._end_of_turn = renderer.tokenizer.end_of_turn_ids
        vision = renderer.vision
        self._banned = tuple(sorted(vision.vision_token_ids)) if vision is not None else ()
        self._writes: set[asyncio.Future[None]] = set()  # store writes not yet finished
        self._background: set[asyncio.Task[None]] = set()  # engine drains
        self._started = False
        self.metrics = GatewayMetrics()
        self.metrics.watch(
            live_sessions=sessions.live,
            active_requests=lambda: self.admission.active,
            engine=self.engine.describe,
            memory=lambda: (sessions.held_bytes, sessions.limits.max_bytes, sessions.images.held_bytes),
            held=sessions.held.by_kind,
        )

    # -- life ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Get the engines ready (remote engines: learn their model, start health checks). Idempotent."""
        if self._started:
            return
        self._started = True
        if isinstance(self.engine, EnginePool):
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
            weights_version=self.gate.version,
            engine=self.engine.describe(),
        )

    # -- the engine pool -----------------------------------------------------------------------------
    def _pool(self) -> EnginePool:
        if not isinstance(self.engine, EnginePool):
            raise InvalidRequest("this gateway runs the embedded engine; start it with --engine to manage engines")
        return self.engine

    def pool(self) -> list[dict[str, Any]]:
        """The remote engines routed to, each described."""
        engines: list[dict[str, Any]] = self._pool().describe()["engines"]
        return engines

    async def add_engine(self, spec: str) -> None:
        """Add a remote engine (`KIND=URL`) once it answers its health check. Only while the weights
        are the ones every engine started with: a new engine would serve those under a later version."""
        pool = self._pool()
        self._check_starting_weights()
        # checked again once it answers: an update may have begun while the engine was asked
        await pool.add_member(spec, self._check_starting_weights)

    def _check_starting_weights(self) -> None:
        if self.updates.running or self.gate.version != 0:  # 0: the weights every engine started with
            raise Conflict(
                f"the pool's weights changed since it started (version {self.gate.version}): an engine added "
                "now would serve its own starting weights under that version; start it with the current "
                "weights and a new gateway, or add it before the first weight update",
                param="add",
                code="weights_changed",
            )

    def drain_engine(self, url: str) -> None:
        """Place no new work on the engine at `url` (from now on); forget it once its requests finish."""
        task = asyncio.get_running_loop().create_task(self._pool().drain_member(url))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- weight updates --------------------------------------------------------------------------------
    @property
    def policy_version(self) -> str | None:
        """The label recorded on each turn (the weights version as a string, or what resume named)."""
        return self.gate.label

    @property
    def paused(self) -> bool:
        return not self.gate.running.is_set()

    def engines(self) -> list[Engine]:
        """Every engine whose weights an update changes: a pool's members (`engines`), or the one."""
        members = getattr(self.engine, "engines", None)
        return list(members) if isinstance(members, list) else [self.engine]

    async def update_weights(
        self,
        version: int,
        *,
        lora: str | None = None,
        model: str | None = None,
        engine_managed: bool = False,
        in_flight: str = "continue",
    ) -> dict[str, Any]:
        """Load new weights on every engine and switch to `version`, atomically (as `POST /admin/weights`):
        the report of each phase's duration, or InvalidRequest/Conflict before anything was paused,
        or UpdateFailed naming the engine (the gateway then stays held until resume or rollback)."""
        body: dict[str, Any] = {"version": version, "in_flight": in_flight}
        body.update({"lora": lora, "model": model, "engine_managed": engine_managed or None})
        return await self.updates.update(parse_update(body))

    def pause(self, *, abort: bool) -> None:
        """Hold new generations (their requests wait, they are not rejected); with `abort`, also stop
        the running ones at their next token (recorded with finish reason "abort"). A generation
        waiting for its answer in one piece has shown nothing yet: it waits too, and goes on (streamed
        from the engine) once resumed."""
        self.gate.operator_hold = True
        self.gate.hold()
        if abort:
            self.gate.abort()

    def resume(self, policy_version: str | int | None) -> None:
        """Release held generations; what they sample is recorded under `policy_version` (an integer,
        or a string that is one, also sets the weights version). Refused while engines may hold
        different weights after a failed update (roll back first)."""
        self.updates.check_resumable()
        version = None if policy_version is None else parse_version(policy_version)
        if version is not None and version < self.gate.version:
            # versions only grow: a lower one would make the tape's version numbers repeat
            raise Conflict(
                f"version {version} is older than the gateway's version {self.gate.version}",
                param="policy_version",
                code="version_not_new",
            )
        if policy_version is not None:
            self.gate.label = str(policy_version)
            if version is not None:
                self.gate.version = version
        self.gate.operator_hold = False
        self.gate.release()

    # -- requests --------------------------------------------------------------------------------------
    def run(self, call: Call, *, streamed: bool = True) -> AsyncGenerator[Event, None]:
        """Stream the events of one request: `Started`, then per choice its deltas and `ChoiceDone`.
        `streamed=False`: the caller reads only the result; each choice then has a single delta."""
        if not isinstance(call, ChatCall):
            return self.complete(call, streamed)
        if self._matches_prefix(call):
            return self.chat(call, streamed)
        return self._serve(call, None, streamed)  # what `chat` does then, one generator fewer per request

    def _matches_prefix(self, call: ChatCall) -> bool:
        """Whether the request goes to the one live session its history extends (unnamed, matching on)."""
        return call.session_id is None and self.sessions.match_prefix

    async def chat(self, call: ChatCall, streamed: bool = True) -> AsyncGenerator[Event, None]:
        match = None
        if self._matches_prefix(call):
            match = self.sessions.match(call.messages)
            call = dataclasses.replace(call, session_id=match.session_id)
        async for event in self._serve(call, None, streamed):
            yield dataclasses.replace(event, prefix_match=match) if match and isinstance(event, Started) else event

    async def complete(self, call: CompletionCall, streamed: bool = True) -> AsyncGenerator[Event, None]:
        # bad prompts fail before a session opens; one that cannot fit even with clipping, before it is tokenized
        try:
            prompt = await self.planner.completion_prompt(call.prompt, self.engine.context_length - 1)
        except PromptTooLong as exc:
            raise overflow_from_floor(self.engine.context_length, exc.floor, call.sampling, clip=True) from None
        async for event in self._serve(call, prompt, streamed):
            yield event

    async def _serve(
        self, call: Call, completion_prompt: list[int] | None, streamed: bool
    ) -> AsyncGenerator[Event, None]:
        async with await self._ticket(call) as ticket:
            session = ticket.session
            if call.retry:
                replayed = await self._replay(ticket)
                if replayed is not None:
                    for event in replayed:
                        yield event
                    return
            await self._check_staleness(session)
            try:
                ticket.claim()
            except Overloaded:
                self.metrics.overloaded()
                raise
            # A session in memory opens without suspending, so requests that arrive together would each
            # be planned and sent to the engine in one step while answers already back wait behind all
            # of them. One turn of the loop here lets those finish first: at 16 sessions, sessions
            # resent from memory ran at 0.8 of the throughput of new ones (whose first request waits
            # for a store read anyway), 1.0 with it.
            await asyncio.sleep(0)
            context = self.engine.context_length
            clip = clips_max_tokens(self.clip_max_tokens, session.tree.outcome.metadata)
            if completion_prompt is not None:
                plan = self.planner.completion(session.tree, completion_prompt)
            else:
                assert isinstance(call, ChatCall)
                try:
                    plan = await self.planner.chat(session.tree, call, prompt_room(context, call.sampling, clip))
                except PromptTooLong as exc:
                    raise overflow_from_floor(context, exc.floor, call.sampling, clip) from None
            sampling = fit_to_context(
                len(plan.prompt), context, self.renderer.tokenizer.vocab_size, call.sampling, clip
            )
            if self._banned:  # a vision model: its placeholders are never sampled
                sampling = dataclasses.replace(sampling, banned_token_ids=self._banned)
            images = await self._prompt_images(session, call, plan)
            session.requests += 1
            constraint = call.constraint if isinstance(call, ChatCall) else None
            choices = [
                self._choice(ticket, plan, sampling, index, constraint, call.trace_id, streamed, images)
                for index in range(sampling.n)
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

    async def _prompt_images(self, session: Session, call: Call, plan: Plan) -> list[PromptImage]:
        """The images of the prompt with their bytes, for the engine: the request's, else read back
        (`ImageLibrary`) for those the session holds; new ones join the session's images."""
        if not plan.images:
            return []
        if not takes_images(self.engine):
            raise InvalidRequest(
                f"the engine ({self.engine.describe().get('kind')}) takes no images: the embedded model has no "
                "vision; serve a vision-language model behind vLLM's token route (--engine vllm-generate=URL)",
                param="messages",
                code="images_not_supported",
            )
        new = call.images if isinstance(call, ChatCall) else {}
        held = [run.digest for run in plan.images if run.digest not in new]
        known = await self.sessions.images.read_all(held) if held else {}
        return [PromptImage(run, new.get(run.digest) or known[run.digest]) for run in plan.images]

    async def _check_staleness(self, session: Session) -> None:
        """A session too old for the policy takes no new turns (marked stale, still exportable); a new
        group waits for room under admission control (429 with Retry-After)."""
        tree = session.tree
        own = session_bound(tree.outcome.metadata)  # set per session at creation
        limit = self.staleness.max_staleness if own is None else own
        # no bound (the default): no need to look for the session's first version on every request
        first = None if limit is None else first_version(tree.nodes)
        if is_stale(first, self.gate.version, limit):
            if tree.outcome.metadata.get("stale") is not True:
                tree.outcome.metadata["stale"] = True
                await self.sessions.persist(session)
            raise Conflict(
                f"session {session.id!r} began under version {first}; the policy is at version "
                f"{self.gate.version} and max_staleness is {limit}",
                param="session_id",
                code="session_stale",
            )
        if self.group_admission is not None and not tree.nodes:
            group = tree.outcome.group_id or f"session:{tree.session_id}"
            if not await self._admit(self.group_admission, group):
                wait = self.group_admission.versions_to_wait(self.gate.version)
                refused = Overloaded(
                    f"admitting group {group!r} would exceed (max_staleness + version + 1) x admit_per_version "
                    f"groups; {wait} more version(s) needed",
                    retry_after=self.admission_retry_after,
                )
                refused.code = "admission_closed"
                raise refused

    async def _admit(self, admission: GroupAdmission, group: str) -> bool:
        """Admit `group` now, or (with `admission_wait`) as soon as a new version makes room within
        that many seconds; False: still no room."""
        deadline = time.monotonic() + self.staleness.admission_wait
        while not admission.admit(group, self.gate.version):
            left = deadline - time.monotonic()
            if left <= 0 or not await self.gate.next_version(left):
                return admission.admit(group, self.gate.version)
        return True

    async def _ticket(self, call: Call) -> Ticket:
        """Open the request's session (read from the store only if it is not in memory) and hold it
        under a ticket."""
        session_id = call.session_id
        session, created = await self.sessions.open(session_id, call.rewrite_policy)
        if session_id is None and call.request_key is not None:
            self.sessions.remember_unnamed(call.request_key, session.id)
        if isinstance(call, ChatCall) and session_id is not None:
            session, created = await self._episode_or_side(session, created, call)
        return Ticket(
            self.sessions,
            self.admission,
            session,
            created=created,
            key=call.request_key,
            track_write=self._track_write,
            on_written=self.metrics.store_write,
        )

    async def _episode_or_side(self, session: Session, created: bool, call: ChatCall) -> tuple[Session, bool]:
        """In a harness's session (named by its own id, or opened with metadata `harness`), a side
        call goes to a session of its own in the episode's group, marked `side_of` (`core.episodes`)."""
        metadata = session.tree.outcome.metadata
        harness = call.harness or metadata.get("harness")
        if not isinstance(harness, str):
            return session, created
        head = episode_head(call.messages)
        if not is_side_call(head, bool(call.options.tools), metadata, harness):
            if "episode_head" not in metadata:
                session.tree.outcome.metadata = {**metadata, "harness": harness, "episode_head": head}
            return session, created
        side, side_created = await self.sessions.open(side_session_id(session.id, head), call.rewrite_policy)
        outcome = side.tree.outcome
        if "side_of" not in outcome.metadata:
            outcome.group_id = session.tree.outcome.group_id or session.id
            outcome.metadata = {**outcome.metadata, "side_of": session.id, "harness": harness}
        return side, side_created

    def _track_write(self, write: asyncio.Future[None]) -> None:
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)

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
        images: Sequence[PromptImage] = (),
    ) -> AsyncGenerator[Event, None]:
        session: Session = ticket.session
        run = ChoiceRun(
            self.engine,
            self.renderer.tokenizer,
            index,
            plan.prompt,
            sampling,
            mode=plan.reply_mode,
            stop_ids=self._end_of_turn,
            session_id=session.id,
            gate=self.gate,
            on_engine_call=self._count_engine_call,
            constraint=constraint,
            streamed=streamed,
            images=images,
        )
        try:
            async for delta in run.stream():
                yield delta
        finally:
            self._observe_generation(run)
            # Record even a cut-short generation: every sampled token stays on the tape.
            # Not what a failed engine answer sent before it failed: that is not trusted.
            if (run.tokens or run.completed) and not run.engine_fault:
                node = self._record(ticket, plan, run, constraint, trace_id, images)
                write = ticket.write(node, [image.image for image in images])
                self.sessions.account(ticket.session)
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
        images: Sequence[PromptImage] = (),
    ) -> TurnNode:
        session = ticket.session
        rewrites = len(session.tree.rewrites)
        for image in images:  # its facts, once per session (the bytes: once in the store, `ImageLibrary`)
            session.tree.images.setdefault(image.image.digest, image.image.facts)
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
            policy_version=run.label,
            policy_spans=tuple(run.spans),
            logprob_mode=run.tokens[0].logprob_mode if run.tokens else None,
            template_inputs=plan.template_inputs,
            constrained=constraint is not None,
            shape_chain=plan.shape_chain,
            sampling=run.sampling.distribution(),
        )
        buffer = node.path_buffer() if node.parent is None else None
        if isinstance(plan.prompt, FirstPromptIds) and buffer is not None:
            plan.prompt.hand_on(session.tree.prompt_text, buffer)  # its text, for the next prompt on the buffer
        self.metrics.turn_recorded(
            prompt_tokens=len(plan.prompt), sampled_tokens=len(run.tokens), finish_reason=run.finish
        )
        for rewrite in session.tree.rewrites[rewrites:]:
            self.metrics.rewrite(rewrite.kind)
        return node

    def _count_engine_call(self) -> None:
        self.engine_calls += 1

    def _observe_generation(self, run: ChoiceRun) -> None:
        if run.started_at is None or run.last_token_at is None:
            return  # no token came: nothing to time
        first = None if run.first_token_at is None else run.first_token_at - run.started_at
        self.metrics.generation(seconds=run.last_token_at - run.started_at, first_token_seconds=first)

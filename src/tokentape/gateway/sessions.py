"""Live sessions: each is one tree of turns, held in memory while in use and always in the store.

A session missing from memory is loaded from the store (off the event loop). Idle sessions leave
memory on a timer; past the size limit the least recently used leave at once. There is no lock:
the event loop runs one task at a time, and a request touches its session's tree only between
awaits (finding its place, attaching a turn), so concurrent calls on one session proceed in
parallel and each lands as its own turn."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from tokentape.core.held import HeldBytes
from tokentape.core.messages import Message, chain_of
from tokentape.core.session import SessionTree
from tokentape.core.staleness import session_bound
from tokentape.core.tape import RewritePolicy
from tokentape.errors import Conflict, InvalidRequest, NotFound, StoreFailure
from tokentape.store.base import TrajectoryStore
from tokentape.store.images import IMAGE_CACHE_BYTES, ImageLibrary
from tokentape.store.scan import ANY_SESSION, PAGE_SIZE, SessionFilter, SessionKey, StoredSession

__all__ = [
    "MemoryLimits",
    "PrefixMatch",
    "Session",
    "SessionRegistry",
    "REWRITE_POLICIES",
    "check_session_id",
    "check_policy",
]

REWRITE_POLICIES: tuple[RewritePolicy, ...] = ("tape", "fork", "strict")
UNNAMED_REQUESTS_KEPT = 4096  # SDK retries come within seconds; this covers minutes of traffic
# What a retry record costs in memory (`sys.getsizeof` of its parts and the dictionary's slot): a
# session's latest request number per retry key (`Session.latest`), and the session an unnamed
# request opened per retry key (`SessionRegistry.remember_unnamed`). Both count toward the budget.
REPLAY_RECORD_BYTES = 160
UNNAMED_RECORD_BYTES = 256
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def check_session_id(session_id: str) -> str:
    """The id, if it is one: the whole string must match (a trailing newline does not)."""
    if not _SESSION_ID.fullmatch(session_id):
        raise InvalidRequest(
            "session ids are 1-128 characters of letters, digits and . _ : - (starting with a letter or digit)",
            param="session_id",
            code="invalid_session_id",
        )
    return session_id


def check_policy(policy: str) -> RewritePolicy:
    for known in REWRITE_POLICIES:
        if policy == known:
            return known
    raise InvalidRequest(f"rewrite_policy must be one of {', '.join(REWRITE_POLICIES)}", param="rewrite_policy")


@dataclass(eq=False, slots=True)
class Claim:
    """A running request that holds its retry key: a retry of it waits for `done`."""

    request: int  # the session's number for the request
    done: asyncio.Future[None]


@dataclass(eq=False)
class Session:
    tree: SessionTree
    requests: int = 0  # requests that passed planning (summaries show it)
    numbered: int = 0  # request numbers handed out (at claim time, planned or not)
    in_flight: int = 0  # requests holding a ticket now; a session is never evicted while one runs
    last_used: float = field(default_factory=time.monotonic)
    claims: dict[bytes, Claim] = field(default_factory=dict)  # request key -> its latest running request
    latest: dict[bytes, int] = field(default_factory=dict)  # request key -> its latest request number
    unstored: set[int] = field(default_factory=set)  # turns whose write failed: never acknowledged or replayed

    @classmethod
    def restored(cls, tree: SessionTree) -> Session:
        """A session reloaded from the store: request numbers and retry keys as its turns recorded them."""
        numbers = {node.request for node in tree.nodes if node.request is not None}
        return cls(tree, requests=len(numbers), numbered=max(numbers, default=0), latest=tree.latest_requests())

    @property
    def id(self) -> str:
        return self.tree.session_id

    @property
    def held_bytes(self) -> int:
        """The tree's bytes and the session's retry records (one per request key it answered)."""
        return self.tree.held_bytes + REPLAY_RECORD_BYTES * len(self.latest)

    def summary(self) -> dict[str, object]:
        # max_staleness: the session's own bound (None: the gateway's --max-staleness applies)
        return {
            **self.tree.summary(),
            "requests": self.requests,
            "max_staleness": session_bound(self.tree.outcome.metadata),
        }

    def check_open(self) -> None:
        if self.tree.outcome.finished:
            raise Conflict(
                f"session {self.id!r} is finished; start a new session", param="session_id", code="session_finished"
            )

    def finish(self) -> None:
        if not self.tree.outcome.finished:
            self.tree.outcome.finished_at = time.time()
        self.tree.digests.clear()  # a finished session takes no more requests


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How an unnamed request was placed in prefix-matching mode (sent back in a response header).

    outcome: `matched` (its history is a live branch of exactly one session: it continues that
    session), `new` (no assistant message to match: a first turn), `ambiguous` (several live
    sessions recorded that same history: a new session), `unmatched` (no live session recorded its
    history, e.g. an edited or compacted one: a new session).
    """

    outcome: str
    session_id: str | None = None  # the session continued (`matched` only)
    candidates: int = 0  # live sessions whose branches the history matched


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """Sessions are always in the store; these bound how many stay in memory as well, and how many
    bytes the gateway may hold there: everything `SessionRegistry.held` counts, by kind (the
    sessions' trees, their turns' template inputs, retry records, image bytes, and what the server
    keeps beside them: parses kept to reuse, Responses conversations). Past the bytes, caches give
    up what they hold, then the least recently used sessions not running leave memory; if the
    running ones alone are past it, new requests wait (429 with Retry-After) instead of the process
    being killed."""

    max_sessions: int = 10_000
    # 4 GiB: on a 24 GiB machine it leaves the engine, the interpreter and the page cache ample room,
    # and holds ~270M recorded tokens (13.9 bytes each, `make bench`) beside 256 MiB of cached image bytes
    max_bytes: int = 4 * 1024**3
    idle_seconds: float = 3600.0  # a session unused this long leaves memory (it reloads on use)
    evict_every: float = 30.0  # how often idle sessions are looked for; a scan costs one pass over the idle ones
    # the cache of image bytes read back from the store; None: an eighth of max_bytes, at most 256 MiB
    image_cache: int | None = None

    @property
    def image_cache_bytes(self) -> int:
        return min(IMAGE_CACHE_BYTES, self.max_bytes // 8) if self.image_cache is None else self.image_cache


class SessionRegistry:
    """Sessions in memory, backed by the store: a session missing from memory is reloaded from it.

    The registry owns the store it is given: `close` and `aclose` close it (`Gateway.aclose` closes
    the registry), and nothing else needs to. Tests and throwaway runs pass `SqliteStore(":memory:")`."""

    def __init__(
        self,
        store: TrajectoryStore,
        *,
        default_policy: RewritePolicy = "tape",
        limits: MemoryLimits = MemoryLimits(),
        match_prefix: bool = False,
    ) -> None:
        self.store = store
        self.default_policy: RewritePolicy = default_policy
        self.match_prefix = match_prefix  # unnamed chat requests continue the one session they extend
        # image bytes by digest: once in the store, read back through a cache bounded in bytes
        self.images = ImageLibrary(self.store, limits.image_cache_bytes)
        self._limits = limits
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._sizes: dict[str, int] = {}  # bytes each session in memory holds, as last counted
        self._template_sizes: dict[str, int] = {}  # of which its turns' template inputs
        self.session_bytes = 0
        self.template_bytes = 0  # the template inputs of the sessions in memory (in `session_bytes`)
        self.evicted = 0
        self.retries_waiting = 0  # SDK retries waiting for the request they repeat to finish
        self._timer: asyncio.TimerHandle | None = None
        self._opening: dict[str, asyncio.Task[tuple[SessionTree | None, bool]]] = {}
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        # request key -> the one-call session an unnamed request opened, so its SDK retry finds it
        self._unnamed: OrderedDict[bytes, str] = OrderedDict()
        # the one account of what the gateway holds, by kind: the budget is checked against its total,
        # /metrics shows it per kind, and past the budget its caches give up bytes before sessions leave
        self.held = HeldBytes(limits.max_bytes)
        self.held.add("tapes", lambda: self.session_bytes - self.template_bytes)
        self.held.add("template_inputs", lambda: self.template_bytes)
        self.held.add("images", lambda: self.images.held_bytes)
        self.held.add("retry_records", lambda: UNNAMED_RECORD_BYTES * len(self._unnamed))

    @property
    def limits(self) -> MemoryLimits:
        return self._limits

    @limits.setter
    def limits(self, limits: MemoryLimits) -> None:
        self._limits = limits
        self.held.budget = limits.max_bytes
        self.images.cache.resize(limits.image_cache_bytes)
        self._trim()

    @property
    def held_bytes(self) -> int:
        """What the gateway holds against the budget: every kind `held` counts (the sessions in
        memory, their template inputs, image bytes, retry records, and what other holders added)."""
        return self.held.total()

    def remember_unnamed(self, request_key: bytes, session_id: str) -> None:
        """Which one-call session an unnamed request opened, for its SDK retry: the latest
        UNNAMED_REQUESTS_KEPT, and no more than a sixty-fourth of the budget in bytes."""
        self._unnamed[request_key] = session_id
        kept = min(UNNAMED_REQUESTS_KEPT, max(1, self.limits.max_bytes // 64 // UNNAMED_RECORD_BYTES))
        while len(self._unnamed) > kept:
            self._unnamed.popitem(last=False)

    def unnamed_session(self, request_key: bytes) -> str | None:
        return self._unnamed.get(request_key)

    def __len__(self) -> int:
        return len(self._sessions)

    def match(self, messages: Sequence[Message]) -> PrefixMatch:
        """The live session an unnamed request continues: the one whose branches recorded the
        request's history up to its last assistant message, reply included.

        Only sessions in memory and not finished are candidates (one dictionary lookup each). The
        whole history must match, so an edited reply never continues a session: it is `unmatched`.
        """
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        if last < 0:
            return PrefixMatch("new")
        chain = chain_of(messages[: last + 1])
        found = [s for s in self._sessions.values() if not s.tree.outcome.finished and s.tree.has_chain(chain)]
        if len(found) == 1:
            self._touch(found[0])
            return PrefixMatch("matched", found[0].id, 1)
        return PrefixMatch("ambiguous" if found else "unmatched", None, len(found))

    def side_sessions(self, session_id: str) -> list[Session]:
        """The side-call sessions of a harness episode held in memory (`core.episodes`)."""
        return [s for s in self._sessions.values() if s.tree.outcome.metadata.get("side_of") == session_id]

    def in_memory(self, session_id: str) -> Session | None:
        """The session if it is in memory now; never reads the store."""
        return self._sessions.get(session_id)

    def live(self) -> int:
        """Sessions in memory and not finished."""
        return sum(1 for session in self._sessions.values() if not session.tree.outcome.finished)

    def _touch(self, session: Session) -> None:
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session.id)

    def _keep(self, session: Session) -> Session:
        """Hold a session in memory, unless another task put it there first while we awaited."""
        held = self._sessions.setdefault(session.id, session)
        self._touch(held)
        self.account(held)
        self._arm_evictions()
        return held

    async def _load(self, session_id: str) -> Session | None:
        session = self._sessions.get(session_id)
        if session is not None:
            self._touch(session)
            return session
        tree = await self.store.load(session_id)
        return None if tree is None else self._keep(Session.restored(tree))

    async def get(self, session_id: str) -> Session:
        """The session, from memory or the store; NotFound if there is none, StoreFailure
        (session_corrupt) if its stored rows cannot be read."""
        session = await self._load(check_session_id(session_id))
        if session is None:
            raise NotFound(f"no session {session_id!r}", param="session_id", code="session_not_found")
        return session

    async def open(self, session_id: str | None, policy: RewritePolicy | None = None) -> tuple[Session, bool]:
        """The named session, created on first use, or a fresh one-call session when unnamed;
        with True when this call created it (it is in memory only until its first write)."""
        if session_id is None:  # a fresh random id cannot be in the store: no read
            fresh = Session(
                SessionTree(f"call-{uuid.uuid4().hex}", policy or self.default_policy, created_at=time.time())
            )
            return self._keep(fresh), True
        check_session_id(session_id)
        if (session := self._sessions.get(session_id)) is not None:
            self._touch(session)
            return session, False
        tree, deleted = await self._lookup(session_id)
        if deleted:
            raise Conflict(f"session {session_id!r} was deleted", param="session_id", code="session_deleted")
        if (session := self._sessions.get(session_id)) is not None:  # loaded or created by another task meanwhile
            self._touch(session)
            return session, False
        if tree is not None:
            return self._keep(Session.restored(tree)), False
        fresh = Session(SessionTree(session_id, policy or self.default_policy, created_at=time.time()))
        return self._keep(fresh), True

    async def _lookup(self, session_id: str) -> tuple[SessionTree | None, bool]:
        """One store read per id at a time: requests opening the same session together share it and
        resume in arrival order, so the first one claims its retry key before a retry looks."""
        reading = self._opening.get(session_id)
        if reading is None:
            reading = asyncio.get_running_loop().create_task(self.store.lookup(session_id))
            self._opening[session_id] = reading
            reading.add_done_callback(lambda _: self._opening.pop(session_id, None))
        return await asyncio.shield(reading)

    async def exists(self, session_id: str) -> bool:
        return await self._load(check_session_id(session_id)) is not None

    def discard(self, session_id: str) -> None:
        """Forget a session that was never written (the requests that opened it recorded nothing)."""
        self._forget(session_id)

    async def delete(self, session_id: str) -> None:
        """Delete a session (also one whose stored rows cannot be read); NotFound if there is none."""
        try:
            await self.get(session_id)
        except StoreFailure as exc:
            if exc.code != "session_corrupt":
                raise
        self._forget(session_id)
        await self.store.delete(session_id)

    async def persist(self, session: Session) -> None:
        """Write a session's row (creation, rewards, finish). A finished session leaves memory once it
        is written and nothing runs in it: its export is served from the store from then on."""
        if not await self.store.save_session(session.tree):
            raise Conflict(f"session {session.id!r} was deleted", param="session_id", code="session_deleted")
        if session.tree.outcome.finished and not session.in_flight and self._sessions.get(session.id) is session:
            self._drop([session.id])

    async def scan(
        self, where: SessionFilter = ANY_SESSION, *, after: SessionKey | None = None, page_size: int = PAGE_SIZE
    ) -> AsyncIterator[StoredSession]:
        """Every stored session matching `where`, in `(created_at, session_id)` order, a page at a
        time: the tree in memory where there is one (it also counts requests), else the stored one,
        which is not kept in memory. Unreadable sessions come with their error."""
        while True:
            keys = await self.store.keys(where, after=after, limit=page_size)
            if not keys:
                return
            missing = [session_id for _, session_id in keys if session_id not in self._sessions]
            loaded = {s.session_id: s for s in await self.store.load_many(missing)} if missing else {}
            for created_at, session_id in keys:
                if (session := self._sessions.get(session_id)) is not None:
                    yield StoredSession(session_id, created_at, session.tree)
                elif (stored := loaded.get(session_id)) is not None:
                    yield stored
            after = keys[-1]

    def summary(self, stored: StoredSession) -> dict[str, object]:
        """A listing's entry: the session's summary, or its id and why it cannot be read."""
        if stored.tree is None:
            return {
                "session_id": stored.session_id,
                "created_at": stored.created_at,  # listings of several stores are ordered by it
                "error": {"message": stored.error, "type": "server_error", "param": None, "code": "session_corrupt"},
            }
        session = self._sessions.get(stored.session_id)
        if session is not None and session.tree is stored.tree:
            return session.summary()
        return Session.restored(stored.tree).summary()

    # -- memory --------------------------------------------------------------------------------------
    def account(self, session: Session) -> None:
        """Count what a session holds now (on loading it and after each recorded turn), then trim."""
        if self._sessions.get(session.id) is not session:
            return
        size = session.held_bytes
        self.session_bytes += size - self._sizes.get(session.id, 0)
        self._sizes[session.id] = size
        inputs = session.tree.template_bytes
        self.template_bytes += inputs - self._template_sizes.get(session.id, 0)
        self._template_sizes[session.id] = inputs
        self._trim()

    def over_budget(self) -> bool:
        """Whether the gateway holds more than the budget in memory even after trimming (the
        running ones cannot leave)."""
        if self.held_bytes <= self.limits.max_bytes:
            return False
        self._trim()  # a holder outside the sessions may have grown since the last turn was counted
        return self.held_bytes > self.limits.max_bytes

    def _trim(self) -> None:
        """Past the count or the bytes, drop the least recently used sessions that are not running.
        Past the bytes, the caches go first: the texts kept of sessions' prompts (which costs the
        next call of a session only the writing of its prompt whole), then those of `held`."""
        excess = len(self._sessions) - self.limits.max_sessions
        over = self.held_bytes - self.limits.max_bytes
        if over > 0:
            over -= self._drop_prompt_texts(over)
        if over > 0:
            over -= self.held.shed(over)
        if excess <= 0 and over <= 0:
            return
        victims: list[str] = []
        newest = next(reversed(self._sessions), None)  # the one just opened stays: its request is about to run
        for session in self._sessions.values():
            if len(victims) >= excess and over <= 0:
                break
            if not session.in_flight and session.id != newest:
                victims.append(session.id)
                over -= self._sizes.get(session.id, 0)
        self._drop(victims)

    def _drop_prompt_texts(self, wanted: int) -> int:
        """Forget the kept prompt texts of the least recently used sessions until `wanted` bytes
        are freed or none is left; the bytes freed."""
        freed = 0
        for session in self._sessions.values():
            if freed >= wanted:
                break
            counted = self._sizes.get(session.id)
            if counted is None or not session.tree.prompt_text.held_bytes:
                continue
            session.tree.prompt_text.clear()
            size = session.held_bytes
            freed += counted - size
            self.session_bytes += size - counted
            self._sizes[session.id] = size
        return freed

    def evict_idle(self, now: float | None = None) -> int:
        """Drop sessions unused for `idle_seconds` (they stay in the store); the number dropped.
        Memory is in order of last use, so this stops at the first session used recently."""
        cutoff = (time.monotonic() if now is None else now) - self.limits.idle_seconds
        victims: list[str] = []
        for session in self._sessions.values():
            if session.last_used > cutoff:
                break
            if not session.in_flight:
                victims.append(session.id)
        self._drop(victims)
        return len(victims)

    def _drop(self, victims: list[str]) -> None:
        """Forget these sessions in memory (the store keeps them)."""
        for session_id in victims:
            self._forget(session_id)
        self.evicted += len(victims)

    def _forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self.session_bytes -= self._sizes.pop(session_id, 0)
        self.template_bytes -= self._template_sizes.pop(session_id, 0)

    def _arm_evictions(self) -> None:
        """Look for idle sessions every `evict_every` seconds, on the loop that serves them."""
        loop = asyncio.get_running_loop()
        if self._timer_loop is loop and self._timer is not None:
            return
        self._timer_loop = loop

        def tick() -> None:
            self.evict_idle()
            self._timer = loop.call_later(self.limits.evict_every, tick)

        self._timer = loop.call_later(self.limits.evict_every, tick)

    def close(self) -> None:
        """Stop the eviction timer, commit every queued write and close the store (it checkpoints
        its log into the database file)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.store.close()

    async def aclose(self) -> None:
        """`close` without blocking the event loop."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await self.store.aclose()

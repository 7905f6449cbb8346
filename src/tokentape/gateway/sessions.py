"""Live sessions: each is one tree of turns in memory, backed by the store. There is no lock: the
event loop runs one task at a time, and a request touches its session's tree only between awaits
(finding its place, attaching a turn), so concurrent calls on one session proceed in parallel and
each lands as its own turn."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokentape.core.messages import Message, chain_of
from tokentape.core.session import SessionTree
from tokentape.core.tape import RewritePolicy
from tokentape.errors import Conflict, InvalidRequest, NotFound
from tokentape.store.sqlite import SqliteStore

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

    def summary(self) -> dict[str, object]:
        return {**self.tree.summary(), "requests": self.requests}

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
    """Sessions are always in the store; these bound how many stay in memory as well."""

    max_sessions: int = 10_000
    idle_seconds: float = 3600.0  # a session unused this long leaves memory (it reloads on use)


class SessionRegistry:
    """Sessions in memory, backed by the store: a session missing from memory is reloaded from it."""

    def __init__(
        self,
        default_policy: RewritePolicy = "tape",
        store: SqliteStore | None = None,
        limits: MemoryLimits = MemoryLimits(),
        *,
        match_prefix: bool = False,
    ) -> None:
        self.default_policy: RewritePolicy = default_policy
        self.match_prefix = match_prefix  # unnamed chat requests continue the one session they extend
        self.store = store or SqliteStore(":memory:")
        self.limits = limits
        self._sessions: dict[str, Session] = {}
        self.evicted = 0
        self.retries_waiting = 0  # SDK retries waiting for the request they repeat to finish
        self._idle_scanned = float("-inf")
        # request key -> the one-call session an unnamed request opened, so its SDK retry finds it
        self._unnamed: OrderedDict[bytes, str] = OrderedDict()

    def remember_unnamed(self, request_key: bytes, session_id: str) -> None:
        self._unnamed[request_key] = session_id
        while len(self._unnamed) > UNNAMED_REQUESTS_KEPT:
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
        found = [s.id for s in self._sessions.values() if not s.tree.outcome.finished and s.tree.has_chain(chain)]
        if len(found) == 1:
            self.get(found[0])  # marks it used
            return PrefixMatch("matched", found[0], 1)
        return PrefixMatch("ambiguous" if found else "unmatched", None, len(found))

    def _load(self, session_id: str) -> Session | None:
        session = self._sessions.get(session_id)
        if session is None:
            tree = self.store.load(session_id)
            if tree is None:
                return None
            session = Session.restored(tree)
            self._sessions[session_id] = session
        session.last_used = time.monotonic()
        return session

    def get(self, session_id: str) -> Session:
        session = self._load(check_session_id(session_id))
        if session is None:
            raise NotFound(f"no session {session_id!r}", param="session_id", code="session_not_found")
        return session

    def open(self, session_id: str | None, policy: RewritePolicy | None = None) -> Session:
        """The named session, created on first use; a fresh one-call session when unnamed."""
        if session_id is None:
            session_id = f"call-{uuid.uuid4().hex}"
        check_session_id(session_id)
        session = self._load(session_id)
        if session is None:
            if self.store.is_deleted(session_id):
                raise Conflict(f"session {session_id!r} was deleted", param="session_id", code="session_deleted")
            session = Session(SessionTree(session_id, policy or self.default_policy, created_at=time.time()))
            self._sessions[session_id] = session
        self._evict()
        return session

    def exists(self, session_id: str) -> bool:
        return self._load(check_session_id(session_id)) is not None

    def discard(self, session_id: str) -> None:
        """Forget a session that was never written (the requests that opened it recorded nothing)."""
        self._sessions.pop(session_id, None)

    def close(self) -> None:
        """Close the store (it checkpoints its log into the database file)."""
        self.store.close()

    async def delete(self, session_id: str) -> None:
        self.get(session_id)
        self._sessions.pop(session_id, None)
        await self.store.delete(session_id)

    async def persist(self, session: Session) -> None:
        """Write a session's row (creation, rewards, finish)."""
        if not await self.store.save_session(session.tree):
            raise Conflict(f"session {session.id!r} was deleted", param="session_id", code="session_deleted")

    def all(self) -> list[Session]:
        """Every stored session: those in memory, and the others loaded for this call only."""
        listed = list(self._sessions.values())
        for session_id in self.store.session_ids():
            if session_id not in self._sessions:
                tree = self.store.load(session_id)
                if tree is not None:
                    listed.append(Session.restored(tree))
        return listed

    def _evict(self) -> None:
        """Drop idle sessions from memory, oldest first, down to the limit. They stay in the store."""
        now = time.monotonic()
        # The idle scan reads every session: do it a few times per idle period, not on every request.
        if now - self._idle_scanned >= min(1.0, self.limits.idle_seconds / 10):
            self._idle_scanned = now
            idle = [
                s for s in self._sessions.values() if not s.in_flight and now - s.last_used > self.limits.idle_seconds
            ]
            for session in idle:
                del self._sessions[session.id]
                self.evicted += 1
        if len(self._sessions) <= self.limits.max_sessions:
            return
        for session in sorted(self._sessions.values(), key=lambda s: s.last_used):
            if len(self._sessions) <= self.limits.max_sessions:
                break
            if not session.in_flight:
                del self._sessions[session.id]
                self.evicted += 1

"""Live sessions: one tree and one lock each. The lock covers finding a request's place and
attaching its turns, not the generation in between, so concurrent calls on one session proceed
in parallel and each lands as its own turn."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass, field

from tokentape.core.session import SessionTree
from tokentape.core.tape import RewritePolicy
from tokentape.errors import Conflict, InvalidRequest, NotFound

__all__ = ["Session", "SessionRegistry", "REWRITE_POLICIES", "check_session_id", "check_policy"]

REWRITE_POLICIES: tuple[RewritePolicy, ...] = ("tape", "fork", "strict")
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def check_session_id(session_id: str) -> str:
    if not _SESSION_ID.match(session_id):
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


@dataclass(eq=False)
class Session:
    tree: SessionTree
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    requests: int = 0

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


class SessionRegistry:
    def __init__(self, default_policy: RewritePolicy = "tape") -> None:
        self.default_policy: RewritePolicy = default_policy
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r}", param="session_id", code="session_not_found")
        return session

    def open(self, session_id: str | None, policy: RewritePolicy | None = None) -> Session:
        """The named session, created on first use; a fresh one-call session when unnamed."""
        if session_id is None:
            session_id = f"call-{uuid.uuid4().hex}"
        check_session_id(session_id)
        session = self._sessions.get(session_id)
        if session is None:
            session = Session(SessionTree(session_id, policy or self.default_policy, created_at=time.time()))
            self._sessions[session_id] = session
        return session

    def exists(self, session_id: str) -> bool:
        return session_id in self._sessions

    def discard(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def delete(self, session_id: str) -> None:
        self.get(session_id)
        del self._sessions[session_id]

    def all(self) -> list[Session]:
        return list(self._sessions.values())

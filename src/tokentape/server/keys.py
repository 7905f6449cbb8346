"""Session keys: issued with their session, kept only as SHA-256 digests (in the store's sessions
row, and a cache of the live ones here), checked in constant time.

A key names its session (`auth.session_of_key`), so checking it is one lookup by that public id and
one `hmac.compare_digest` of two 32-byte digests: the time taken does not depend on how close a
guess is, nor on its length beyond hashing it. A session reloaded after a restart keeps its key:
the digest is read from the store on first use.
"""

from __future__ import annotations

import enum
import hmac

from tokentape.core.session import SessionTree
from tokentape.errors import Conflict
from tokentape.gateway.sessions import SessionRegistry
from tokentape.server.auth import key_digest, new_session_key, session_of_key

__all__ = ["KeyState", "SessionKeys"]

_CACHED = 100_000  # live sessions' digests kept in memory (32 bytes and an id each); the store has all


class KeyState(enum.Enum):
    UNKNOWN = "unknown"  # not a session key, a wrong secret, or a session with no key
    LIVE = "live"
    FINISHED = "finished"  # the right key of a finished session
    DELETED = "deleted"  # the right key of a deleted session


class SessionKeys:
    """The keys of one gateway's sessions, and how many requests each key has in flight."""

    def __init__(self, sessions: SessionRegistry, max_in_flight: int | None = None) -> None:
        self.sessions = sessions
        self.max_in_flight = max_in_flight  # per session key; None: no cap of its own
        self._live: dict[str, bytes] = {}  # session id -> its key's digest
        self._in_flight: dict[str, int] = {}

    async def issue(self, tree: SessionTree) -> str:
        """A new key for a session just created; its digest is written with the session's row.
        The key itself is returned once and kept nowhere."""
        key = new_session_key(tree.session_id)
        digest = key_digest(key.encode())
        if not await self.sessions.store.save_session_key(tree, digest):
            raise Conflict(f"session {tree.session_id!r} was deleted", param="session_id", code="session_deleted")
        self._remember(tree.session_id, digest)
        return key

    async def check(self, key: bytes) -> tuple[KeyState, str | None]:
        """What `key` is, and the session it names (None if it names none)."""
        session_id = session_of_key(key)
        if session_id is None:
            return KeyState.UNKNOWN, None
        digest = key_digest(key)
        stored = self._live.get(session_id)
        if stored is not None:
            if not hmac.compare_digest(digest, stored):
                return KeyState.UNKNOWN, session_id
            session = self.sessions.in_memory(session_id)
            if session is not None and session.tree.outcome.finished:  # finished without this gateway's route
                self._live.pop(session_id, None)
                return KeyState.FINISHED, session_id
            return KeyState.LIVE, session_id
        state = await self.sessions.store.key_state(session_id)
        if state is None or not hmac.compare_digest(digest, state[0]):
            return KeyState.UNKNOWN, session_id
        _, finished, deleted = state
        if deleted:
            return KeyState.DELETED, session_id
        if finished:
            return KeyState.FINISHED, session_id
        self._remember(session_id, state[0])
        return KeyState.LIVE, session_id

    def revoke(self, session_id: str) -> None:
        """The session was finished or deleted: its key is checked against the store again."""
        self._live.pop(session_id, None)

    def take(self, session_id: str) -> bool:
        """Count a request of this session's key in; False if its cap is reached (only called
        when there is a cap)."""
        held = self._in_flight.get(session_id, 0)
        if self.max_in_flight is not None and held >= self.max_in_flight:
            return False
        self._in_flight[session_id] = held + 1
        return True

    def release(self, session_id: str) -> None:
        held = self._in_flight.get(session_id, 0) - 1
        if held > 0:
            self._in_flight[session_id] = held
        else:
            self._in_flight.pop(session_id, None)

    def in_flight(self, session_id: str) -> int:
        return self._in_flight.get(session_id, 0)

    def _remember(self, session_id: str, digest: bytes) -> None:
        if len(self._live) >= _CACHED:
            self._live.clear()
        self._live[session_id] = digest

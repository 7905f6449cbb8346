"""The store seam: what the gateway and the server ask of a trajectory store (`sqlite.SqliteStore`
is the one there is; tests and benchmarks pass `SqliteStore(":memory:")` to keep nothing).

Writes are queued the moment they are called and return a `Write`: awaiting it returns after that
write's own commit, or raises `StoreFailure`. Reads are coroutines that never block the event loop.
Closing commits every queued write first; writes queued after it fail with `StoreFailure`.

Whoever holds a store closes it once: a `SessionRegistry` owns the store it is given and closes it
with itself (`Gateway.aclose` closes the registry)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from tokentape.core.images import DecodedImage
from tokentape.core.session import SessionTree
from tokentape.core.tape import TurnNode
from tokentape.store.scan import ANY_SESSION, PAGE_SIZE, SessionFilter, SessionKey, StoredSession
from tokentape.store.writer import Write

__all__ = ["TrajectoryStore", "Write"]


class TrajectoryStore(Protocol):
    """Sessions' rows, their turns, their key digests and the images they show, by digest."""

    # -- writes: queued when called; await the returned Write for the commit -----------------------
    def save_turn(
        self,
        tree: SessionTree,
        node: TurnNode,
        request_key: bytes | None = None,
        images: Mapping[str, DecodedImage] | None = None,
    ) -> Write[bool]:
        """One turn and its session row, committed together; False if the session was deleted."""
        ...

    def save_session(self, tree: SessionTree) -> Write[bool]:
        """A session's row (creation, rewards, finish); False if the session was deleted."""
        ...

    def save_session_key(self, tree: SessionTree, digest: bytes) -> Write[bool]:
        """A session's row with the digest of its key; False if the session was deleted."""
        ...

    def delete(self, session_id: str) -> Write[None]:
        """Remove a session's turns and leave a tombstone that refuses later writes."""
        ...

    # -- reads ---------------------------------------------------------------------------------------
    async def read_images(self, digests: Iterable[str]) -> dict[str, DecodedImage]:
        """The stored images of `digests` with their bytes, by digest (one not stored is absent)."""
        ...

    async def load(self, session_id: str) -> SessionTree | None:
        """The stored session, None if there is none or it was deleted; `StoreFailure`
        (session_corrupt) if its rows cannot be read."""
        ...

    async def lookup(self, session_id: str) -> tuple[SessionTree | None, bool]:
        """`load` and whether the session was deleted, in one read."""
        ...

    async def key_state(self, session_id: str) -> tuple[bytes, bool, bool] | None:
        """The digest of the session's key, whether it is finished and whether it was deleted;
        None if the session has no key."""
        ...

    async def keys(
        self, where: SessionFilter = ANY_SESSION, *, after: SessionKey | None = None, limit: int = PAGE_SIZE
    ) -> list[SessionKey]:
        """Up to `limit` stored sessions' keys, in `(created_at, session_id)` order, strictly after `after`."""
        ...

    async def load_many(self, session_ids: Sequence[str]) -> list[StoredSession]:
        """Several sessions in one read; an unreadable one comes back with its error, not raised."""
        ...

    # -- shutdown --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Commit every queued write and release the store (idempotent)."""
        ...

    async def aclose(self) -> None:
        """`close` without blocking the event loop."""
        ...

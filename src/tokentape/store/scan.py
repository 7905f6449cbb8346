"""Reading many stored sessions a page at a time, in one order, from one store or several.

Every store lists its sessions by `(created_at, session_id)`. A scan yields them in that order and
never holds more than a page in memory; `merge` gathers the scans of several stores (one SQLite
shard per gateway process) into one stream in the same order, so an exporter reads every shard the
way it reads one. A session whose rows cannot be read comes out with its `error` set and no tree:
one bad session never stops the others.
"""

from __future__ import annotations

import base64
import heapq
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson

from tokentape.core.session import SessionTree
from tokentape.errors import InvalidRequest

__all__ = [
    "ANY_SESSION",
    "PAGE_SIZE",
    "SessionFilter",
    "SessionKey",
    "StoredSession",
    "decode_cursor",
    "encode_cursor",
    "merge",
]

SessionKey = tuple[float, str]  # (created_at, session_id): the order every listing and export uses
PAGE_SIZE = 64  # sessions per read when scanning: bounds the memory of a listing or an export


@dataclass(frozen=True, slots=True)
class SessionFilter:
    """Which sessions a listing or export wants; None means any."""

    group_id: str | None = None
    finished: bool | None = None
    since: float | None = None  # created at or after
    until: float | None = None  # created before
    prefix: str | None = None  # session id prefix
    side_calls: bool | None = None  # a harness's side-call sessions (metadata `side_of`): with them, without, only

    def matches(self, tree: SessionTree) -> bool:
        outcome = tree.outcome
        return (
            (self.side_calls is None or ("side_of" in outcome.metadata) == self.side_calls)
            and (self.group_id is None or outcome.group_id == self.group_id)
            and (self.finished is None or outcome.finished == self.finished)
            and (self.since is None or outcome.created_at >= self.since)
            and (self.until is None or outcome.created_at < self.until)
            and (self.prefix is None or tree.session_id.startswith(self.prefix))
        )


ANY_SESSION = SessionFilter()


@dataclass(frozen=True, slots=True)
class StoredSession:
    """One session as a scan yields it: its tree, or why it could not be read."""

    session_id: str
    created_at: float
    tree: SessionTree | None
    error: str | None = None

    @property
    def key(self) -> SessionKey:
        return (self.created_at, self.session_id)


def encode_cursor(key: SessionKey) -> str:
    """An opaque token for the page after `key`."""
    return base64.urlsafe_b64encode(orjson.dumps(list(key))).decode("ascii")


def decode_cursor(cursor: str) -> SessionKey:
    try:
        created_at, session_id = orjson.loads(base64.urlsafe_b64decode(cursor.encode("ascii")))
        if isinstance(created_at, bool) or not isinstance(created_at, int | float) or not isinstance(session_id, str):
            raise ValueError("not a session key")
    except (ValueError, TypeError, UnicodeError, orjson.JSONDecodeError):
        raise InvalidRequest("cursor is not one this server returned", param="cursor") from None
    return (float(created_at), session_id)


async def merge(*scans: AsyncIterator[StoredSession]) -> AsyncIterator[StoredSession]:
    """The sessions of several stores in one `(created_at, session_id)` order. Each input must be
    in that order already (every store's scan is); a session id found in two inputs is yielded once,
    from the first input that has it."""
    heap: list[tuple[SessionKey, int, StoredSession]] = []
    for index, scan in enumerate(scans):
        first = await anext(scan, None)
        if first is not None:
            heap.append((first.key, index, first))
    heapq.heapify(heap)
    last: SessionKey | None = None
    while heap:
        key, index, stored = heapq.heappop(heap)
        if key != last:
            yield stored
            last = key
        following = await anext(scans[index], None)
        if following is not None:
            heapq.heappush(heap, (following.key, index, following))

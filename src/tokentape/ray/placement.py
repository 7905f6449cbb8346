"""Where sessions live in a cluster of gateways: pure bookkeeping, no Ray, no I/O.

A session is owned by one gateway for its whole life (its tree is in that process's memory and its
turns in that gateway's store shard). A new session goes to the gateway with the fewest unfinished
sessions; the sessions of one group go where the group's first session went, so a group-shaped
export (Atropos) never has to be stitched together from several shards.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

__all__ = ["EngineBook", "SessionPlacement"]

STICKY_SESSIONS_KEPT = 100_000  # engine affinity is a hint: losing an old entry costs a cache miss


@dataclass(slots=True)
class SessionPlacement:
    urls: dict[int, str] = field(default_factory=dict)  # gateway index -> its HTTP base URL
    _owner: dict[str, int] = field(default_factory=dict)
    _group_owner: dict[str, int] = field(default_factory=dict)
    _open: Counter[int] = field(default_factory=Counter)  # unfinished sessions per gateway
    _finished: set[str] = field(default_factory=set)

    def add_gateway(self, index: int, url: str) -> None:
        self.urls[index] = url
        self._open.setdefault(index, 0)

    def owner(self, session_id: str) -> int | None:
        return self._owner.get(session_id)

    def place(self, session_id: str, group_id: str | None = None) -> int:
        """The session's gateway: where it already is, else its group's, else the least loaded."""
        if (known := self._owner.get(session_id)) is not None:
            return known
        if not self.urls:
            raise LookupError("no gateway has joined the cluster")
        chosen = self._group_owner.get(group_id) if group_id else None
        if chosen is None or chosen not in self.urls:
            chosen = min(self.urls, key=lambda index: (self._open[index], index))
        self.record(session_id, chosen, group_id)
        return chosen

    def record(self, session_id: str, index: int, group_id: str | None = None) -> None:
        """A placement made elsewhere (a gateway that already holds the session in its shard)."""
        if self._owner.get(session_id) == index:
            return
        self._owner[session_id] = index
        if group_id:
            self._group_owner.setdefault(group_id, index)
        if session_id not in self._finished:
            self._open[index] += 1

    def finished(self, session_id: str) -> None:
        index = self._owner.get(session_id)
        if index is not None and session_id not in self._finished:
            self._finished.add(session_id)
            self._open[index] -= 1

    def forget(self, session_id: str) -> None:
        self.finished(session_id)
        self._owner.pop(session_id, None)
        self._finished.discard(session_id)

    def load(self) -> dict[int, int]:
        """Unfinished sessions per gateway."""
        return {index: self._open[index] for index in self.urls}


@dataclass(slots=True)
class EngineBook:
    """Engines shared by every gateway: requests in flight on each, cluster-wide, and the engine
    each session last used (its prefix cache holds the session's history)."""

    in_flight: Counter[str] = field(default_factory=Counter)
    sessions: Counter[str] = field(default_factory=Counter)  # sessions whose last turn ran there
    _sticky: OrderedDict[str, str] = field(default_factory=OrderedDict)
    moves: int = 0  # sessions that changed engine because theirs was not usable

    def acquire(self, session_id: str | None, usable: list[str]) -> str:
        """The engine for one generation among `usable` (healthy, not draining, as the asking
        gateway sees them): the session's own if usable, else the least loaded."""
        if not usable:
            raise LookupError("no usable engine")
        placed = self._sticky.get(session_id) if session_id else None
        if placed is not None and placed in usable:
            chosen = placed
            self._sticky.move_to_end(session_id)  # type: ignore[arg-type]
        else:  # least in flight; among equals, the one holding fewest sessions
            chosen = min(usable, key=lambda name: (self.in_flight[name], self.sessions[name], usable.index(name)))
            if session_id:
                if placed is not None:
                    self.moves += 1
                    self.sessions[placed] -= 1
                self._sticky[session_id] = chosen
                self.sessions[chosen] += 1
                while len(self._sticky) > STICKY_SESSIONS_KEPT:
                    self.sessions[self._sticky.popitem(last=False)[1]] -= 1
        self.in_flight[chosen] += 1
        return chosen

    def release(self, name: str) -> None:
        if self.in_flight[name] > 0:
            self.in_flight[name] -= 1

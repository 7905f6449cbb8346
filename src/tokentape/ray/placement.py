"""Where sessions live in a cluster of gateways: pure bookkeeping, no Ray, no I/O.

A session is owned by one gateway for its whole life (its tree is in that process's memory and its
turns in that gateway's store shard). A new session goes to the gateway with the fewest unfinished
sessions; the sessions of one group go where the group's first session went, so a group-shaped
export (Atropos) never has to be stitched together from several shards.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["SessionPlacement"]


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

    def sessions_of(self, index: int) -> int:
        return sum(1 for owner in self._owner.values() if owner == index)

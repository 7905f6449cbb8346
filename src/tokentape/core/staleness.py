"""Bounded staleness, pure: which sessions are too old to go on, which new groups may start, which
samples (or tokens) an export keeps.

A session's age is the version of its first sampled token. With `max_staleness` K, a session whose
first token is older than `current - K` gets no new turns (its turns stay exportable, marked stale):
the trainer never receives an episode sampled across more than K + 1 versions.

Admission in AReaL's form: with B groups per version, a new group is admitted only while the groups
admitted since version 0 stay within (K + current + 1) x B, so that no more groups run ahead of the
trainer than it can consume before they grow stale.

`max_lag` filters an export against the current version: `drop` removes a sample whose oldest token
is older than `current - lag`; `mask` keeps it and takes those tokens out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokentape.core.versions import parse_version, token_versions

__all__ = [
    "GroupAdmission",
    "LagWindow",
    "LagMode",
    "Staleness",
    "admission_limit",
    "first_version",
    "is_stale",
    "lag_filter",
    "session_bound",
]

LagMode = Literal["drop", "mask"]


@dataclass(frozen=True, slots=True)
class Staleness:
    max_staleness: int | None = None  # K; None: unbounded
    admit_per_version: int | None = None  # B; None: no admission control
    admission_wait: float = 0.0  # seconds a group that does not fit waits for a new version before its 429


def session_bound(metadata: dict[str, Any]) -> int | None:
    """A session's own max_staleness (set at creation, kept in its metadata), if it has a valid one."""
    own = metadata.get("max_staleness")
    return own if isinstance(own, int) and not isinstance(own, bool) and own >= 0 else None


def first_version(nodes: Sequence[Any]) -> int | None:
    """The version of a session's first sampled token (turns in the order recorded); None if unknown."""
    for node in nodes:
        if node.sampled:  # the version of its first token alone (not one per token of the turn)
            return token_versions(node.policy_spans, 1, default=parse_version(node.policy_version))[0]
    return None


def is_stale(first: int | None, current: int, max_staleness: int | None) -> bool:
    """Whether a session whose first token was sampled under `first` may take no more turns."""
    return max_staleness is not None and first is not None and first < current - max_staleness


def admission_limit(current: int, max_staleness: int, per_version: int) -> int:
    """Groups that may have been admitted since version 0 while the trainer is at `current`."""
    return (max_staleness + current + 1) * per_version


class GroupAdmission:
    """The groups admitted so far; a group is counted once, when its first session starts.

    Only the count of every group admitted since version 0 enters the limit; the names are kept for
    groups admitted in the last K + 1 versions (a group's sessions start together, so a later one
    is recognised), and forgotten after: the record stays as small as the groups in flight. A
    session of a forgotten group that starts later counts as a new group (refused sooner, never
    admitted past the limit)."""

    def __init__(self, max_staleness: int, per_version: int) -> None:
        if max_staleness < 0 or per_version < 1:
            raise ValueError("max_staleness must be >= 0 and per_version >= 1")
        self.max_staleness = max_staleness
        self.per_version = per_version
        self.count = 0  # groups admitted since version 0
        self.recent: dict[str, int] = {}  # group -> the version it was admitted under (the last K + 1)
        self._pruned_at = 0

    def _forget(self, current: int) -> None:
        if current != self._pruned_at:  # once per version
            self._pruned_at = current
            oldest = current - self.max_staleness
            self.recent = {group: v for group, v in self.recent.items() if v >= oldest}

    def admit(self, group: str, current: int) -> bool:
        """Admit `group` (True), or refuse it for now (False): admitting would exceed the limit."""
        self._forget(current)
        if group in self.recent:
            return True
        if self.count + 1 > admission_limit(current, self.max_staleness, self.per_version):
            return False
        self.count += 1
        self.recent[group] = current
        return True

    def versions_to_wait(self, current: int) -> int:
        """How many versions must pass before one more group fits."""
        needed = self.count + 1
        return max(0, -(-needed // self.per_version) - self.max_staleness - 1 - current)


@dataclass(frozen=True, slots=True)
class LagWindow:
    """An export's `max_lag`: tokens sampled under a version older than `current - max_lag` are too old."""

    current: int
    max_lag: int
    mode: LagMode = "drop"

    @property
    def oldest(self) -> int:
        return self.current - self.max_lag


def lag_filter(row: dict[str, Any], current: int, max_lag: int, mode: LagMode) -> dict[str, Any] | None:
    """One exported row (with `versions` and `loss_mask`, as `export_branch` makes them) under
    `max_lag`: None to drop it, or the row with too-old tokens masked out (`mask`)."""
    oldest = current - max_lag
    versions: list[int] = row["versions"]
    old = [0 <= v < oldest for v in versions]
    if not any(old):
        return row
    if mode == "drop":
        return None
    mask = [0 if too_old else m for m, too_old in zip(row["loss_mask"], old, strict=True)]
    return {**row, "loss_mask": mask, "masked_by_lag": sum(old)}

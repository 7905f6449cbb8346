"""Policy versions: which weights sampled which token.

A weights version is an integer that only grows: 0 is the weights the engines started with, and each
update names the next (`POST /admin/weights {"version": N}`). A turn records the versions of its
sampled tokens as spans over them (`[start, end)` offsets into the turn's sampled tokens), closed at
each seam where an update landed while the turn ran. Under `keep` a span also names the oldest
version whose KV its tokens may have been sampled on (`kv_version`).

The older free-form label (`/admin/resume {"policy_version": ...}`) stays a string on each turn; a
label that is a decimal integer is that version.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PolicySpan", "add_span", "parse_version", "spans_from_json", "spans_to_json", "token_versions"]


@dataclass(frozen=True, slots=True)
class PolicySpan:
    version: int
    start: int
    end: int
    kv_version: int | None = None  # set under keep: the tokens ran on KV at least this old

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "start": self.start, "end": self.end}
        if self.kv_version is not None:
            out["kv_version"] = self.kv_version
        return out


def add_span(spans: list[PolicySpan], version: int, start: int, end: int, kv_version: int | None = None) -> None:
    """Append `[start, end)` sampled under `version`, merged into the last span when nothing differs."""
    if end <= start:
        return
    last = spans[-1] if spans else None
    if last is not None and last.end == start and (last.version, last.kv_version) == (version, kv_version):
        spans[-1] = PolicySpan(version, last.start, end, kv_version)
    else:
        spans.append(PolicySpan(version, start, end, kv_version))


def parse_version(label: str | int | None) -> int | None:
    """The integer version a label names, None when it names none."""
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        return int(label)
    return None


def token_versions(spans: Sequence[PolicySpan], count: int, default: int | None = None) -> list[int | None]:
    """One version per sampled token; `default` where no span covers it (a turn recorded before spans)."""
    out: list[int | None] = [default] * count
    for span in spans:
        for i in range(max(0, span.start), min(span.end, count)):
            out[i] = span.version
    return out


def spans_to_json(spans: Sequence[PolicySpan]) -> str | None:
    return json.dumps([span.as_dict() for span in spans]) if spans else None


def spans_from_json(text: str | None) -> tuple[PolicySpan, ...]:
    if not text:
        return ()
    return tuple(
        PolicySpan(int(d["version"]), int(d["start"]), int(d["end"]), d.get("kv_version")) for d in json.loads(text)
    )


def node_versions(node: Any) -> list[int | None]:
    """One version per sampled token of a turn: its spans, or its label where it has none."""
    return token_versions(node.policy_spans, len(node.sampled), default=parse_version(node.policy_version))


def version_fields(branch: Any) -> dict[str, Any]:
    """What trainers read about versions, for one branch (a `tape.BranchView`):
    versions               per token: the version that sampled it, -1 where nothing was sampled or the
                           version is not known (AReaL's per-token `versions`)
    param_version_start    the oldest and newest version over its sampled tokens (verl's names)
    param_version_end
    policy_spans           per turn: its spans, offsets into that turn's sampled tokens"""
    per_node: dict[int, list[int | None]] = {}
    versions: list[int] = []
    for position, (origin, depth) in enumerate(zip(branch.origins, branch.turns, strict=True)):
        if int(origin) != 1:  # Origin.SAMPLED
            versions.append(-1)
            continue
        node = branch.nodes[depth]
        known = per_node.get(depth)
        if known is None:
            known = per_node[depth] = node_versions(node)
        version = known[position - node.sampled_start]
        versions.append(-1 if version is None else version)
    sampled = [v for v in versions if v >= 0]
    return {
        "versions": versions,
        "param_version_start": min(sampled) if sampled else None,
        "param_version_end": max(sampled) if sampled else None,
        "policy_spans": [[span.as_dict() for span in node.policy_spans] for node in branch.nodes],
    }

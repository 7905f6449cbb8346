"""Which session a request names: one reading for every generation route and the cluster's routing.

Precedence, the first one sent wins:

1. the base URL's session (`/sessions/{id}/v1/...`);
2. the `X-Session-ID` header (a session key at the root sets it to the key's session);
3. the body's `session_id` field (what OpenRLHF's agents send);
4. an agent harness's own id, where it sends one (`HARNESS_HEADERS`, then `HARNESS_FIELDS`):
   Claude Code's `X-Claude-Code-Session-Id` header and the `session_id` its `metadata.user_id`
   carries; Codex's `session-id` (or `thread-id`) header and its `prompt_cache_key`. One harness run
   is then one session with nothing to set.

The harness itself (which sorts its side calls out of the episode, `core.episodes`) is known by its
id, or by its User-Agent (`HARNESS_AGENTS`: opencode names its session with `X-Session-ID`).

Conflicts: 2 and 3 naming different sessions is a 400. Under 1, a different 2 or 3 is kept as the
client's trace id. A harness id is only read when none of 1-3 is sent (a harness run under a
session's base URL keeps its own id out of the way), and one that is not a valid session id is no
name at all: it is the harness's, not an answer to this gateway.

Pure: the callers hand over the headers and the parsed body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from tokentape.errors import InvalidRequest
from tokentape.gateway.sessions import check_session_id

__all__ = [
    "HARNESS_AGENTS",
    "HARNESS_FIELDS",
    "HARNESS_HEADERS",
    "SESSION_HEADER",
    "Named",
    "harness_of_agent",
    "harness_session",
    "named_session",
    "valid_name",
]

SESSION_HEADER = "x-session-id"
# (header, harness), read in this order
HARNESS_HEADERS: tuple[tuple[str, str], ...] = (
    ("x-claude-code-session-id", "claude-code"),
    ("session-id", "codex"),
    ("session_id", "codex"),
    ("thread-id", "codex"),
)
# a harness known by its User-Agent (opencode names its session with X-Session-ID, the others carry their id)
HARNESS_AGENTS: tuple[tuple[str, str], ...] = (
    ("claude-cli/", "claude-code"),
    ("codex_", "codex"),
    ("opencode/", "opencode"),
)
# body fields: prompt_cache_key (Codex: its session id), metadata.user_id (Claude Code: JSON with session_id)
HARNESS_FIELDS = ("prompt_cache_key", "metadata.user_id")

Source = Literal["path", "header", "body", "harness"]


@dataclass(frozen=True, slots=True)
class Named:
    """The session a request names, where the name came from, and a differing name kept as trace id."""

    session_id: str | None
    source: Source | None = None
    trace_id: str | None = None
    harness: str | None = None  # the harness the request comes from (its id, or its User-Agent), if known


def valid_name(name: Any) -> str | None:
    """`name` if it is a valid session id, else None (never raises)."""
    if not isinstance(name, str) or not name:
        return None
    try:
        return check_session_id(name)
    except InvalidRequest:
        return None


def _checked(name: str | None) -> str | None:
    """A session name as sent (an empty one counts as none), or InvalidRequest."""
    return check_session_id(name) if name else None


def harness_of_agent(user_agent: str | None) -> str | None:
    """The harness a User-Agent names, if it is one of `HARNESS_AGENTS`."""
    if not user_agent:
        return None
    return next((harness for prefix, harness in HARNESS_AGENTS if user_agent.startswith(prefix)), None)


def harness_session(headers: Mapping[str, str], body: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(session id, harness) from a harness's own id, or None."""
    for header, harness in HARNESS_HEADERS:
        if (name := valid_name(headers.get(header))) is not None:
            return name, harness
    if body is None:
        return None
    if (name := valid_name(body.get("prompt_cache_key"))) is not None:
        return name, "codex"
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    if isinstance(user_id, str) and user_id[:1] == "{" and len(user_id) <= 4096:
        try:
            carried = orjson.loads(user_id)
        except orjson.JSONDecodeError:
            return None
        if isinstance(carried, dict) and (name := valid_name(carried.get("session_id"))) is not None:
            return name, "claude-code"
    return None


def named_session(
    in_path: str | None, headers: Mapping[str, str], body: Mapping[str, Any] | None, *, harness_ids: bool = True
) -> Named:
    """The session a request names, by the precedence and conflict rule above. `body` is the parsed
    JSON object (None: not parsed or not an object). Raises InvalidRequest for an invalid explicit
    name and for a header and body field that disagree."""
    path_name = _checked(in_path)
    field = body.get("session_id") if body is not None else None
    header_name = _checked(headers.get(SESSION_HEADER))
    body_name = _checked(field) if isinstance(field, str) else None
    agent = harness_of_agent(headers.get("user-agent"))
    if path_name is not None:
        trace = next((n for n in (header_name, body_name) if n is not None and n != path_name), None)
        return Named(path_name, "path", trace, agent)
    if header_name is not None and body_name is not None and header_name != body_name:
        raise InvalidRequest(
            "the X-Session-ID header and the session_id field name different sessions", param="session_id"
        )
    if header_name is not None:
        return Named(header_name, "header", harness=agent)
    if body_name is not None:
        return Named(body_name, "body", harness=agent)
    if harness_ids and (found := harness_session(headers, body)) is not None:
        return Named(found[0], "harness", harness=found[1])
    return Named(None, harness=agent)

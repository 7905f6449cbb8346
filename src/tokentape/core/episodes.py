"""An agent harness's episode and its side calls.

A coding-agent harness (Claude Code, Codex, opencode) runs one episode per run, but not every model
call it makes belongs to it: it also asks for a title, a summary, a quota probe, or runs a subagent
with a prompt of its own. Recorded in the episode's session, each would become a branch of it and a
training row of the episode. So in a harness's session a call is the episode's, or a side call that
goes to a session of its own (`side_session_id`), in the episode's group and marked as a side call.

The rule, decided per call from what the call carries (so two calls racing each other are sorted
the same whatever their order):

- the episode's head is the first message of its first call (its system prompt, as a harness sends
  one); a call whose first message differs is a side call (a subagent, a title, a summary);
- a harness whose episode offers tools (all three do, every call) is known by name: a call of its
  that offers none is a side call, even before the episode's first call is recorded;
- anything else is the episode's: a history the harness rewrote (compaction, cleared thinking) goes
  through the rewrite policy as any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import xxhash

from tokentape.core.messages import Message

__all__ = ["HARNESSES_WITH_TOOLS", "episode_head", "is_side_call", "side_session_id"]

# harnesses whose episode calls always offer tools: a call of theirs without tools is a side call
HARNESSES_WITH_TOOLS = frozenset({"claude-code", "codex", "opencode"})
_SEED = 0x65706973  # fixed: heads are kept in a session's metadata, across restarts
_SIDE = ".side-"


def episode_head(messages: Sequence[Message]) -> str:
    """A digest of a call's first message (role and content), stable across processes."""
    if not messages:
        return ""
    first = messages[0]
    canonical = orjson.dumps({"role": first.get("role"), "content": first.get("content")}, option=orjson.OPT_SORT_KEYS)
    return xxhash.xxh3_64_hexdigest(canonical, seed=_SEED)


def is_side_call(head: str, offers_tools: bool, metadata: Mapping[str, Any], harness: str | None) -> bool:
    """Whether a call with this head is a side call of the harness episode whose session metadata
    is `metadata` (its `episode_head` once recorded)."""
    recorded = metadata.get("episode_head")
    if isinstance(recorded, str) and recorded != head:
        return True
    return not offers_tools and harness in HARNESSES_WITH_TOOLS


def side_session_id(session_id: str, head: str) -> str:
    """The side session a call with this head goes to: one per distinct head, so a harness's
    repeated side call (a title each turn) is one session of several calls. At most 128 characters."""
    return f"{session_id[: 128 - len(_SIDE) - 12]}{_SIDE}{head[:12]}"

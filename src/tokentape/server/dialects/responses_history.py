"""The conversations `previous_response_id` continues (`ResponseHistory`): kept in memory per stored
response, within a count and a byte bound, each counted once however many later responses extend it."""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass, field

import orjson

from tokentape.core.held import HeldBytes, parsed_bytes
from tokentape.core.messages import Message
from tokentape.errors import NotFound

__all__ = ["RESPONSES_KEPT", "RESPONSES_KEPT_BYTES", "ResponseHistory"]

RESPONSES_KEPT = 100_000  # conversations kept for previous_response_id, at most
# and at most this many bytes of them (as `ResponseHistory` counts), nor more than an eighth of the budget
RESPONSES_KEPT_BYTES = 256 << 20


@dataclass(eq=False, slots=True)
class _Conversation:
    session_id: str
    messages: list[Message]
    size: int  # the bytes it is counted for: those it shares with the one it extends are counted there
    extends: str | None  # the response whose conversation it starts with (the same message objects)
    extended_by: list[str] = field(default_factory=list)


class ResponseHistory:
    """What `previous_response_id` continues: per stored response, its session and the whole
    conversation up to and including the reply (without the instructions, which are per request).
    Kept in memory, least recently stored out first, within `kept` conversations and `max_bytes`
    (and an eighth of the gateway's budget where it counts in one: `held`, kind "responses").

    A conversation is counted as its messages' JSON parse would hold (`core.held.parsed_bytes`). One
    that continues its session's last (`previous_response_id`: the same message objects, then more)
    is counted for its new messages only; when the one it continues leaves, its count passes on, so
    what stays counted is never less than what stays held."""

    def __init__(
        self, kept: int = RESPONSES_KEPT, max_bytes: int = RESPONSES_KEPT_BYTES, held: HeldBytes | None = None
    ) -> None:
        self.kept = kept
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._held = held
        self._entries: OrderedDict[str, _Conversation] = OrderedDict()
        self._latest: dict[str, str] = {}  # session -> its last stored response
        if held is not None:
            held.add("responses", lambda: self.held_bytes)

    @property
    def bound(self) -> int:
        budget = self._held.budget if self._held is not None else 0
        return min(self.max_bytes, budget // 8) if budget > 0 else self.max_bytes

    def remember(self, response_id: str, session_id: str, conversation: list[Message]) -> None:
        self._drop(response_id)
        base_id = self._latest.get(session_id)
        base = self._entries.get(base_id) if base_id is not None else None
        shared = len(base.messages) if base is not None else 0
        if base is None or shared > len(conversation) or not all(map(operator.is_, base.messages, conversation)):
            base, shared = None, 0
        size = _conversation_bytes(conversation[shared:])
        entry = _Conversation(session_id, conversation, size, base_id if base is not None else None)
        if base is not None:
            base.extended_by.append(response_id)
        self._entries[response_id] = entry
        self._latest[session_id] = response_id
        self.held_bytes += size
        bound = self.bound
        while self._entries and (len(self._entries) > self.kept or self.held_bytes > bound):
            self._drop(next(iter(self._entries)))

    def recall(self, response_id: str) -> tuple[str, list[Message]]:
        found = self._entries.get(response_id)
        if found is None:
            raise NotFound(
                f"no stored response '{response_id}' (responses created with store=false are not kept)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return found.session_id, found.messages

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self.held_bytes -= entry.size
        if self._latest.get(entry.session_id) == response_id:
            del self._latest[entry.session_id]
        for later in entry.extended_by:  # they still hold its messages: they count them now
            if (child := self._entries.get(later)) is not None and child.extends == response_id:
                child.size += entry.size
                child.extends = None
                self.held_bytes += entry.size


def _conversation_bytes(messages: list[Message]) -> int:
    try:
        return parsed_bytes(orjson.dumps(messages))
    except TypeError:  # not JSON orjson writes (never from a request): counted by its text
        return 4 * len(repr(messages))

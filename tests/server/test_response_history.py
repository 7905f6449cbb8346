"""The conversations kept for `previous_response_id` are bounded in bytes within the gateway's one
account (kind "responses"): counted as their parse would hold, a continued conversation for its new
messages only, and what stays counted never less than what stays held when older ones leave."""

from __future__ import annotations

import orjson
import pytest

from tokentape.core.held import HeldBytes, parsed_bytes
from tokentape.errors import NotFound
from tokentape.server.dialects.responses_history import ResponseHistory


def _message(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_a_continued_conversation_is_counted_for_its_new_messages_and_inherits_when_its_base_leaves() -> None:
    held = HeldBytes(budget=1 << 30)
    history = ResponseHistory(held=held)
    first = [_message("a" * 1000), {"role": "assistant", "content": "ok"}]
    history.remember("r1", "s", first)
    assert held.by_kind()["responses"] == parsed_bytes(orjson.dumps(first))
    second = [*first, _message("b" * 500), {"role": "assistant", "content": "fine"}]  # the same objects, then more
    history.remember("r2", "s", second)
    assert history.held_bytes == parsed_bytes(orjson.dumps(first)) + parsed_bytes(orjson.dumps(second[2:]))
    history._drop("r1")  # the base leaves: the one that continues it still holds its messages
    assert history.held_bytes >= parsed_bytes(orjson.dumps(second[2:])) + parsed_bytes(orjson.dumps(first))
    assert history.recall("r2") == ("s", second)
    with pytest.raises(NotFound):
        history.recall("r1")


def test_conversations_stay_within_their_bytes_oldest_out_first() -> None:
    held = HeldBytes(budget=8 << 20)  # an eighth of it: 1 MiB
    history = ResponseHistory(held=held)
    for i in range(40):
        history.remember(f"r{i}", f"s{i}", [_message(chr(97 + i % 26) * 100_000)])
        assert held.by_kind()["responses"] <= 1 << 20
    assert history.recall("r39")[0] == "s39"
    with pytest.raises(NotFound):
        history.recall("r0")
    history_by_count = ResponseHistory(kept=3)
    for i in range(5):
        history_by_count.remember(f"c{i}", "s", [_message(str(i))])
    with pytest.raises(NotFound):
        history_by_count.recall("c1")

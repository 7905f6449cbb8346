"""What RL clients want when a request's `max_tokens` passes the room left in the context: opt in and
get that room (finish `length`), as vLLM-backed trainers do; OpenAI's 400 stays the default."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME
from tokentape.client import InProcessGateway
from tokentape.gateway.service import Gateway
from tokentape.rollout import context_overflow
from tokentape.served import Served

FILLER = "one two three four five six seven eight nine ten " * 96  # about a thousand tokens


def _request(room_wanted: int) -> dict[str, object]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": FILLER + "Now count on from eleven, in words."}],
        "max_tokens": room_wanted,
        "temperature": 0.0,
    }


async def test_max_tokens_past_the_context_is_refused_by_default_and_clipped_on_request(
    gateway: Gateway, built: Served
) -> None:
    local = InProcessGateway(served=built)
    context = gateway.engine.context_length
    try:
        await local.create_session("refused")
        with pytest.raises(openai.BadRequestError) as refused:
            await local.client("refused").chat.completions.create(**_request(200))  # type: ignore[call-overload]
        assert refused.value.code == "context_length_exceeded"
        assert (await local.http.get("/sessions/refused")).json()["turns"] == 0  # nothing recorded

        await local.create_session("clipped", metadata={"max_tokens": "clip"})
        reply = await local.client("clipped").chat.completions.create(**_request(200))  # type: ignore[call-overload]
        room = context - len(reply.prompt_token_ids)  # type: ignore[attr-defined]
        assert 0 < room < 200
        assert reply.choices[0].finish_reason == "length"
        assert len(reply.choices[0].token_ids) == room  # type: ignore[attr-defined]

        gateway.clip_max_tokens = True  # the whole gateway: sessions need not ask
        await local.create_session("server-wide")
        wide = await local.client("server-wide").chat.completions.create(**_request(200))  # type: ignore[call-overload]
        assert wide.choices[0].finish_reason == "length" and len(wide.choices[0].token_ids) == room  # type: ignore[attr-defined]
        # a prompt that alone fills the context is refused all the same
        await local.create_session("full", metadata={"max_tokens": "clip"})
        full = _request(1) | {"messages": [{"role": "user", "content": FILLER * 2}]}
        with pytest.raises(openai.BadRequestError) as overflow:
            await local.client("full").chat.completions.create(**full)  # type: ignore[call-overload]
        assert overflow.value.code == "context_length_exceeded"
    finally:
        gateway.clip_max_tokens = False
        await local.aclose()


async def test_the_overflow_is_recognised_in_every_dialect_and_other_errors_are_not(http: httpx.AsyncClient) -> None:
    """The same overflow through the OpenAI and the Anthropic routes, as a plain HTTP error: both say
    `context_length_exceeded` (a header; the Anthropic body has no code field); a bad value does not."""
    big = [{"role": "user", "content": FILLER * 2}]
    bodies = {
        "/v1/chat/completions": {"model": MODEL_NAME, "messages": big, "max_tokens": 4},
        "/v1/messages": {"model": MODEL_NAME, "messages": big, "max_tokens": 4},
    }
    for path, body in bodies.items():
        response = await http.post(path, json=body)
        with pytest.raises(httpx.HTTPStatusError) as raised:
            response.raise_for_status()
        assert response.status_code == 400 and context_overflow(raised.value), path
    bad = await http.post("/v1/messages", json={"model": MODEL_NAME, "messages": big, "max_tokens": -1})
    with pytest.raises(httpx.HTTPStatusError) as other:
        bad.raise_for_status()
    assert bad.status_code == 400 and not context_overflow(other.value)

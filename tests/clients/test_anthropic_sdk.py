"""The anthropic SDK against /v1/messages: tools (tool_use, tool_result), thinking off, streamed and
not, its API key sent as x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from tests.clients.conftest import API_KEY, CITY_PARAMETERS, CITY_TOOL_DESCRIPTION, SYSTEM, anthropic_history, export
from tests.support.wire import RecordingTransport, assert_on_tape
from tokentape.launcher import RunningServer

TOOL: Any = {"name": "get_weather", "description": CITY_TOOL_DESCRIPTION, "input_schema": CITY_PARAMETERS}


def _client(
    server: RunningServer, session: str, wire: RecordingTransport, key: str = API_KEY
) -> anthropic.AsyncAnthropic:
    # the SDK sends its key as x-api-key, which the gateway accepts
    return anthropic.AsyncAnthropic(
        base_url=f"{server.base_url}/sessions/{session}", api_key=key, http_client=wire.client(), max_retries=0
    )


@pytest.mark.parametrize("streamed", [False, True])
async def test_tool_use_round_trip(server: RunningServer, model: str, streamed: bool) -> None:
    session = f"anthropic-tools-{streamed}"
    wire = RecordingTransport()
    client = _client(server, session, wire)
    messages: list[Any] = [*anthropic_history(), {"role": "user", "content": "What is the weather in Rome?"}]
    # this SDK no longer takes sampling parameters; greedy decoding goes in the body
    settings: Any = {
        "model": model,
        "max_tokens": 60,
        "system": SYSTEM,
        "tools": [TOOL],
        "extra_body": {"temperature": 0},
    }
    settings["thinking"] = {"type": "disabled"}
    if streamed:
        async with client.messages.stream(messages=messages, **settings) as stream:
            kinds = [event.type async for event in stream]
            reply: Any = await stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    else:
        reply = await client.messages.create(messages=messages, **settings)
    assert reply.stop_reason == "tool_use"
    (use,) = [block for block in reply.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Rome"}
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "cloudy"}]},
    ]
    answer = await client.messages.create(messages=messages, **settings)
    assert answer.stop_reason == "end_turn"
    assert "cloudy" in "".join(block.text for block in answer.content if block.type == "text")
    tape = export(server, session)
    assert tape["summary"]["turns"] == 2 and tape["summary"]["branches"] == 1 and tape["summary"]["rewrites"] == 0
    assert_on_tape(tape, wire.turns())


async def test_stop_sequences_and_logprobs(server: RunningServer, model: str) -> None:
    wire = RecordingTransport()
    client = _client(server, "anthropic-stop", wire)
    reply: Any = await client.messages.create(
        model=model,
        max_tokens=40,
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        stop_sequences=["5"],
        extra_body={"logprobs": True, "temperature": 0},
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "5"
    assert "5" not in reply.content[0].text
    assert_on_tape(export(server, "anthropic-stop"), wire.turns())
    assert wire.turns()[0].logprobs is not None


async def test_errors_come_in_anthropics_shape(server: RunningServer, model: str) -> None:
    wire = RecordingTransport()
    with pytest.raises(anthropic.BadRequestError) as bad:
        await _client(server, "anthropic-bad", wire).messages.create(
            model=model, max_tokens=0, messages=[{"role": "user", "content": "Hi"}]
        )
    assert bad.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": bad.value.body["error"]["message"]},
    }  # type: ignore[index]
    assert "max_tokens" in bad.value.message
    with pytest.raises(anthropic.NotFoundError) as missing:
        await _client(server, "anthropic-bad", wire).messages.create(
            model="claude-unknown", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as denied:
        await _client(server, "anthropic-bad", wire, key="wrong").messages.create(
            model=model, max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]

"""The openai SDK's `responses.create`: plain, streamed, function tools, previous_response_id."""

from __future__ import annotations

import json
from typing import Any

import openai

from tests.clients.conftest import API_KEY, CITY_PARAMETERS, CITY_TOOL_DESCRIPTION, SYSTEM, export, responses_history
from tests.support.wire import RecordingTransport, assert_on_tape
from tokentape.launcher import RunningServer

TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": CITY_TOOL_DESCRIPTION,
    "parameters": CITY_PARAMETERS,
}


def _client(server: RunningServer, session: str, wire: RecordingTransport) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.session_url(session), api_key=API_KEY, http_client=wire.client(), max_retries=0
    )


async def test_plain_and_streamed_responses(server: RunningServer, model: str) -> None:
    wire = RecordingTransport()
    client = _client(server, "responses-plain", wire)
    first = await client.responses.create(
        model=model,
        input="Name a colour.",
        max_output_tokens=16,
        temperature=0,
        include=["message.output_text.logprobs"],
    )
    assert first.output_text and first.status in ("completed", "incomplete")
    assert first.usage is not None and first.usage.output_tokens == len((first.model_extra or {})["token_ids"])
    texts: list[str] = []
    final = None
    async with client.responses.stream(
        model=model, input="Name a fruit.", max_output_tokens=16, temperature=0
    ) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                texts.append(event.delta)
            # the reply may or may not end within its 16 tokens: the stream closes on either event
            # (the SDK's get_final_response() knows only the first)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert final is not None and final.status in ("completed", "incomplete")
    assert "".join(texts) == final.output_text
    tape = export(server, "responses-plain")
    assert len(tape["branches"]) == 2  # two unrelated first turns: two branches
    assert_on_tape(tape, wire.turns())
    assert [t.logprobs is not None for t in wire.turns()] == [True, False]


async def test_previous_response_id_continues_the_turn(server: RunningServer, model: str) -> None:
    wire = RecordingTransport()
    client = _client(server, "responses-chain", wire)
    first = await client.responses.create(
        model=model, instructions=SYSTEM, input="Hi!", max_output_tokens=12, temperature=0
    )
    second = await client.responses.create(
        model=model,
        instructions=SYSTEM,
        input="Tell me more.",
        previous_response_id=first.id,
        max_output_tokens=12,
        temperature=0,
    )
    head = (first.model_extra or {})["prompt_token_ids"] + (first.model_extra or {})["token_ids"]
    assert (second.model_extra or {})["prompt_token_ids"][: len(head)] == head
    tape = export(server, "responses-chain")
    assert tape["summary"]["branches"] == 1 and tape["summary"]["turns"] == 2 and tape["summary"]["rewrites"] == 0
    assert_on_tape(tape, wire.turns())


async def test_function_tool_round_trip_streamed_and_not(server: RunningServer, model: str) -> None:
    for stream in (False, True):
        session = f"responses-tools-{stream}"
        wire = RecordingTransport()
        client = _client(server, session, wire)
        items: list[Any] = [*responses_history(), {"role": "user", "content": "What is the weather in Rome?"}]
        if stream:
            async with client.responses.stream(
                model=model, instructions=SYSTEM, input=items, tools=[TOOL], temperature=0, max_output_tokens=60
            ) as events:
                reply = await events.get_final_response()
        else:
            reply = await client.responses.create(
                model=model, instructions=SYSTEM, input=items, tools=[TOOL], temperature=0, max_output_tokens=60
            )
        (call,) = [item for item in reply.output if item.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}
        # the agent resends the whole history with the call and its output, as stateless agents do
        items += [item.model_dump(exclude_none=True) for item in reply.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "cloudy"})
        answer = await client.responses.create(
            model=model, instructions=SYSTEM, input=items, tools=[TOOL], temperature=0, max_output_tokens=30
        )
        assert "cloudy" in answer.output_text
        tape = export(server, session)
        assert tape["summary"]["branches"] == 1 and tape["summary"]["rewrites"] == 0
        assert_on_tape(tape, wire.turns())

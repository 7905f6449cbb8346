"""Real client libraries against a real `tokentape serve` on the embedded model. Every call's token
data, read off the wire, is checked against the session export."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tokentape.launcher import RunningServer, running_server

API_KEY = "client-test-key"
CITY_TOOL_DESCRIPTION = "Get the current weather in a city"
CITY_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
EARLIER = [("Berlin", "sunny"), ("Madrid", "hot"), ("Oslo", "snowing")]
SYSTEM = "You are a helpful assistant."


@pytest.fixture(scope="session")  # one per worker: each test names its own sessions
def server() -> Iterator[RunningServer]:
    with running_server(["--context-length", "4096", "--api-key", API_KEY]) as running:
        yield running


@pytest.fixture(scope="session")
def model(server: RunningServer) -> str:
    name: str = httpx.get(f"{server.base_url}/v1/models", headers=auth()).json()["data"][0]["id"]
    return name


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def export(server: RunningServer, session: str) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/sessions/{session}/export", headers=auth())
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def chat_history() -> list[dict[str, Any]]:
    """Three earlier weather look-ups: with them in the history SmolLM2 calls the tool at temperature 0."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i, (city, weather) in enumerate(EARLIER):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
        }
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": weather},
            {"role": "assistant", "content": f"It is {weather} in {city}."},
        ]
    return messages


def responses_history() -> list[dict[str, Any]]:
    """The same history as Responses input items."""
    items: list[dict[str, Any]] = []
    for i, (city, weather) in enumerate(EARLIER):
        items += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "type": "function_call",
                "call_id": f"call_{i}",
                "name": "get_weather",
                "arguments": json.dumps({"city": city}),
            },
            {"type": "function_call_output", "call_id": f"call_{i}", "output": weather},
            {"role": "assistant", "content": f"It is {weather} in {city}."},
        ]
    return items


def anthropic_history() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, (city, weather) in enumerate(EARLIER):
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": city}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": weather}]},
            {"role": "assistant", "content": f"It is {weather} in {city}."},
        ]
    return messages

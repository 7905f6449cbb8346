"""Agents hold only their session's key, against a real `tokentape serve` with a trainer key: an
openai SDK loop, an anthropic SDK loop and an openai-agents run go through whole; the same agents
asking for a reward, a finish, an export or the admin routes get 403, and nothing changes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.auth.walk import MODEL, TRAINER, spoiled
from tokentape.launcher import RunningServer, running_server

T = {"authorization": f"Bearer {TRAINER}"}
FORBIDDEN = [  # what a policy could learn to call: pay itself, end itself, read itself or others, stop everything
    ("POST", "/sessions/{own}/reward", {"reward": 1.0}),
    ("POST", "/sessions/{own}/finish", {}),
    ("GET", "/sessions/{own}/export", None),
    ("GET", "/sessions/{other}/export", None),
    ("GET", "/sessions", None),
    ("GET", "/export", None),
    ("DELETE", "/sessions/{other}", None),
    ("POST", "/admin/pause", {"abort": True}),
    ("GET", "/metrics", None),
]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(["--context-length", "4096", "--api-key", TRAINER]) as running:
        yield running


def session(server: RunningServer, name: str) -> dict[str, Any]:
    created = httpx.post(f"{server.base_url}/sessions", json={"session_id": name}, headers=T)
    assert created.status_code == 201, created.text
    data: dict[str, Any] = created.json()
    return data


def state(server: RunningServer) -> Any:
    return httpx.get(f"{server.base_url}/export", headers=T).json(), httpx.get(
        f"{server.base_url}/admin/status", headers=T
    ).json()


def turns(server: RunningServer, name: str) -> int:
    count: int = httpx.get(f"{server.base_url}/sessions/{name}", headers=T).json()["turns"]
    return count


async def test_an_openai_sdk_agent_with_its_key_alone(server: RunningServer) -> None:
    created, other = session(server, "oa-agent"), session(server, "oa-other")
    key = created["api_key"]
    # at the root: the key names the session
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    messages: list[Any] = []
    for i in range(3):
        messages.append({"role": "user", "content": f"Count to {i + 2}."})
        reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    based = openai.AsyncOpenAI(base_url=created["base_url"], api_key=key, max_retries=0)
    await based.completions.create(model=MODEL, prompt="Once", max_tokens=4)
    assert turns(server, "oa-agent") == 4 and turns(server, "oa-other") == 0
    before = state(server)
    root = client.with_options(base_url=server.base_url)
    for method, path, body in FORBIDDEN:
        path = path.format(own="oa-agent", other="oa-other")
        with pytest.raises(openai.PermissionDeniedError):
            if method == "GET":
                await root.get(path, cast_to=object)
            elif method == "DELETE":
                await root.delete(path, cast_to=object)
            else:
                await root.post(path, body=body, cast_to=object)
    with pytest.raises(openai.PermissionDeniedError):  # another session's base URL
        await client.with_options(base_url=other["base_url"]).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    with pytest.raises(openai.AuthenticationError):  # the secret is what counts
        await client.with_options(api_key=spoiled(key)).models.list()
    assert state(server) == before


async def test_an_anthropic_sdk_agent_with_its_key_alone(server: RunningServer) -> None:
    created = session(server, "an-agent")
    session(server, "an-other")
    client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key=created["api_key"], max_retries=0)
    messages: list[Any] = []
    for i in range(2):
        messages.append({"role": "user", "content": f"Name {i + 2} colours."})
        reply = await client.messages.create(model=MODEL, max_tokens=8, messages=messages)
        messages.append({"role": "assistant", "content": reply.content[0].text})  # type: ignore[union-attr]
    assert turns(server, "an-agent") == 2
    before = state(server)
    for method, path, body in FORBIDDEN:
        path = path.format(own="an-agent", other="an-other")
        with pytest.raises(anthropic.PermissionDeniedError) as refused:
            if method == "GET":
                await client.get(path, cast_to=object)
            elif method == "DELETE":
                await client.delete(path, cast_to=object)
            else:
                await client.post(path, body=body, cast_to=object)
        assert refused.value.status_code == 403
    with pytest.raises(anthropic.PermissionDeniedError) as refused:  # Anthropic's error shape on its route
        await client.messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"session_id": "an-other"},
        )
    assert refused.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
    assert state(server) == before


calls: list[str] = []


@pytest.fixture(scope="module")
def agents() -> ModuleType:
    """openai-agents, imported when its test runs rather than in every worker's collection (its
    import alone takes about a second)."""
    import agents

    agents.set_tracing_disabled(True)  # no trace upload: there is no network here
    return agents


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    calls.append(city)
    return "cloudy"


async def test_an_openai_agents_run_with_its_key_alone(agents: ModuleType, server: RunningServer) -> None:
    created = session(server, "ag-agent")
    client = openai.AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="You are a helpful assistant.",
        tools=[agents.function_tool(get_weather)],
        model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=60),
    )
    history: list[Any] = []
    for i, (city, weather) in enumerate([("Berlin", "sunny"), ("Madrid", "hot"), ("Oslo", "snowing")]):
        history += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "type": "function_call",
                "call_id": f"c{i}",
                "name": "get_weather",
                "arguments": json.dumps({"city": city}),
            },
            {"type": "function_call_output", "call_id": f"c{i}", "output": weather},
            {"role": "assistant", "content": f"It is {weather} in {city}."},
        ]
    calls.clear()
    result = await agents.Runner.run(
        agent, input=[*history, {"role": "user", "content": "What is the weather in Rome?"}]
    )
    assert calls == ["Rome"] and "cloudy" in str(result.final_output)
    assert turns(server, "ag-agent") >= 2
    before = state(server)
    for path in ("/sessions/ag-agent/reward", "/admin/pause"):
        with pytest.raises(openai.PermissionDeniedError):
            await client.with_options(base_url=server.base_url).post(path, body={"reward": 1.0}, cast_to=object)
    assert state(server) == before

"""LangChain's ChatOpenAI (a bound tool, streamed and not) and pydantic-ai (structured output, which
it asks for with tool_choice "required", enforced on the embedded model by a grammar).

Both frameworks are imported by the tests that drive them, not at the module's top: together they
take about two seconds to import, which every test worker would otherwise pay while collecting."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.clients.conftest import API_KEY, EARLIER, SYSTEM, export
from tests.support.wire import RecordingHttpxTransport, RecordingTransport, assert_on_tape
from tokentape.launcher import RunningServer

if TYPE_CHECKING:
    from langchain_core.messages import BaseMessage
    from langchain_core.tools import BaseTool


@functools.cache
def _weather_tool() -> BaseTool:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "cloudy"

    return get_weather


def _langchain_history() -> list[BaseMessage]:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    messages: list[BaseMessage] = [SystemMessage(SYSTEM)]
    for i, (city, weather) in enumerate(EARLIER):
        messages += [
            HumanMessage(f"What is the weather in {city}?"),
            AIMessage("", tool_calls=[{"id": f"call_{i}", "name": "get_weather", "args": {"city": city}}]),
            ToolMessage(weather, tool_call_id=f"call_{i}"),
            AIMessage(f"It is {weather} in {city}."),
        ]
    return messages


@pytest.mark.parametrize("streamed", [False, True])
async def test_langchain_chat_openai_tool_loop(server: RunningServer, model: str, streamed: bool) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    get_weather = _weather_tool()
    session = f"langchain-{streamed}"
    wire = RecordingHttpxTransport()
    llm = ChatOpenAI(
        model=model,
        base_url=server.session_url(session),
        api_key=API_KEY,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=60,
        max_retries=0,
        http_async_client=httpx.AsyncClient(transport=wire),
    ).bind_tools([get_weather])
    messages = [*_langchain_history(), HumanMessage("What is the weather in Rome?")]
    if streamed:
        reply: Any = None
        async for chunk in llm.astream(messages):
            reply = chunk if reply is None else reply + chunk
    else:
        reply = await llm.ainvoke(messages)
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Rome"}
    messages += [reply, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = await llm.ainvoke(messages)
    assert "cloudy" in str(answer.content)
    tape = export(server, session)
    assert tape["summary"]["turns"] == 2 and tape["summary"]["branches"] == 1 and tape["summary"]["rewrites"] == 0
    assert_on_tape(tape, wire.turns())


class City(BaseModel):
    name: str
    country: str


async def test_pydantic_ai_structured_output_is_enforced(server: RunningServer, model: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    wire = RecordingTransport()
    client = openai.AsyncOpenAI(base_url=server.session_url("pydantic-ai"), api_key=API_KEY, http_client=wire.client())
    agent = Agent(OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client)), output_type=City)
    result = await agent.run("Name a big city in France.", model_settings={"temperature": 0, "max_tokens": 60})
    assert isinstance(result.output, City) and result.output.name and result.output.country
    tape = export(server, "pydantic-ai")
    assert tape["branches"][0]["constrained"] == [True]  # its tool_choice "required" was enforced
    assert_on_tape(tape, wire.turns())
    (exchange,) = wire.exchanges
    (call,) = exchange.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == result.output.model_dump()

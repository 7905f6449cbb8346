"""openai-agents: its default model (the Responses API) and OpenAIChatCompletionsModel, each running a
function tool, streamed and not; every model call found on the export token for token."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.clients.conftest import API_KEY, SYSTEM, export, responses_history
from tests.support.wire import RecordingTransport, assert_on_tape
from tokentape.launcher import RunningServer

if TYPE_CHECKING:
    from agents import Agent

calls: list[str] = []


@pytest.fixture(scope="module")
def agents() -> ModuleType:
    """openai-agents, imported when these tests run rather than in every worker's collection (its
    import alone takes about a second)."""
    import agents

    agents.set_tracing_disabled(True)  # no trace upload: there is no network here
    return agents


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    calls.append(city)
    return "cloudy"


def _agent(agents: ModuleType, model: Any) -> Agent[Any]:
    agent: Agent[Any] = agents.Agent(
        name="weather",
        instructions=SYSTEM,
        tools=[agents.function_tool(get_weather)],
        model=model,
        model_settings=agents.ModelSettings(temperature=0, max_tokens=60),
    )
    return agent


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
@pytest.mark.parametrize("streamed", [False, True])
async def test_agent_calls_the_tool_and_answers(
    agents: ModuleType, server: RunningServer, model: str, api: str, streamed: bool
) -> None:
    session = f"agents-{api}-{streamed}"
    wire = RecordingTransport()
    client = openai.AsyncOpenAI(base_url=server.session_url(session), api_key=API_KEY, http_client=wire.client())
    if api == "responses":  # the default model of openai-agents
        llm: Any = agents.OpenAIResponsesModel(model=model, openai_client=client)
    else:
        llm = agents.OpenAIChatCompletionsModel(model=model, openai_client=client)
    items: list[Any] = [*responses_history(), {"role": "user", "content": "What is the weather in Rome?"}]
    calls.clear()
    if streamed:
        result: Any = agents.Runner.run_streamed(_agent(agents, llm), input=items)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
    else:
        result = await agents.Runner.run(_agent(agents, llm), input=items)
    assert calls == ["Rome"]
    assert "cloudy" in str(result.final_output)
    paths = {exchange.path for exchange in wire.exchanges}
    assert paths == {f"/sessions/{session}/v1/{'responses' if api == 'responses' else 'chat/completions'}"}
    tape = export(server, session)
    assert tape["summary"]["turns"] == 2 and tape["summary"]["branches"] == 1 and tape["summary"]["rewrites"] == 0
    assert_on_tape(tape, wire.turns())

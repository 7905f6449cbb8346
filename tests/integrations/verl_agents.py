"""Ordinary agents (an `openai.AsyncOpenAI` client and the row's `raw_prompt` in, a reward out), as a
user would name them in the `agent` key of verl's agent loop YAML."""

from __future__ import annotations

from typing import Any

import openai

from tests.integrations.openrlhf_agents import ADD_TOOL, add_tool_result

FOLLOW_UP = "Thank you. Say it once more, briefly."
SUMMARY = "Summary of the talk so far: the user asked a question and the assistant answered it."


async def _model(client: openai.AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def tool_agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]]) -> float:
    """A tool loop of three calls: tool results go back while the model calls tools, a follow-up
    question when it answers. Rewarded 0.25 per tool call served (the test reads the reward, not what
    the model said)."""
    model = await _model(client)
    messages = list(prompt)
    tool_calls = 0
    for _ in range(3):
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=[ADD_TOOL], max_tokens=24, temperature=0.7
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            tool_calls += 1
            result = add_tool_result(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not message.tool_calls:
            messages.append({"role": "user", "content": FOLLOW_UP})
    return 0.25 * tool_calls


async def two_turn_agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]]) -> None:
    """Two turns and no reward of its own: verl's reward manager scores the sample."""
    model = await _model(client)
    messages = list(prompt)
    for _ in range(2):
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0.5)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
        messages += [{"role": "user", "content": FOLLOW_UP}]


async def long_agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]]) -> float:
    """Asks for more than any short response_length holds, turn after turn, until refused."""
    model = await _model(client)
    messages = list(prompt)
    for _ in range(20):
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0.5)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
        messages += [{"role": "user", "content": FOLLOW_UP}]
    return 1.0


async def failing_agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]]) -> float:
    """One turn, then a bug of its own."""
    model = await _model(client)
    await client.chat.completions.create(model=model, messages=list(prompt), max_tokens=8, temperature=0.5)
    raise KeyError("the agent's own bug")


async def refused_agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]]) -> float:
    """One turn, then a request the gateway refuses (an unknown role)."""
    model = await _model(client)
    await client.chat.completions.create(model=model, messages=list(prompt), max_tokens=8, temperature=0.5)
    bad: Any = [{"role": "narrator", "content": "?"}]
    await client.chat.completions.create(model=model, messages=bad, max_tokens=8)
    return 1.0


async def sibling_and_compacting_agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]]) -> float:
    """Two drafts (n=2), a follow-up on the second, then the history compacted into a summary and one
    more turn on it: three branches, the last turn on the compacted one."""
    model = await _model(client)
    messages = list(prompt)
    drafts = await client.chat.completions.create(
        model=model, messages=messages, n=2, max_tokens=10, temperature=1.0, seed=7
    )
    messages += [{"role": "assistant", "content": drafts.choices[1].message.content or ""}]
    messages += [{"role": "user", "content": FOLLOW_UP}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0.5)
    compacted = [{"role": "user", "content": SUMMARY}, {"role": "user", "content": FOLLOW_UP}]
    await client.chat.completions.create(model=model, messages=compacted, max_tokens=10, temperature=0.5)
    return 0.5

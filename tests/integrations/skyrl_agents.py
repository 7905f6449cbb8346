"""Agents for SkyRL's generator: the ordinary ones of the verl tests, and one that takes SkyRL's row
(its third parameter) and runs the agent the row names in `env_extras["agent"]`."""

from __future__ import annotations

from typing import Any

import openai

from tests.integrations import verl_agents


async def by_row(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], row: dict[str, Any]) -> float | None:
    """The agent named by the row (`env_extras["agent"]`, one of `verl_agents`'), so one batch mixes them."""
    assert row["trajectory_id"] and row["env_class"] == "tokentape"  # SkyRL's row reaches the agent
    agent = getattr(verl_agents, row["env_extras"]["agent"])
    result: float | None = await agent(client, prompt)
    return result


async def syncing_agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], row: dict[str, Any]) -> None:
    """Two turns; between them the row's `between_turns()` runs (the test's weight sync lands while the
    agent works), and no reward of its own."""
    model = (await client.models.list()).data[0].id
    messages = list(prompt)
    for turn in range(2):
        if turn:
            row["env_extras"]["between_turns"]()
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0.5)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
        messages += [{"role": "user", "content": verl_agents.FOLLOW_UP}]

"""Ordinary agents (an `openai.AsyncOpenAI` client in, a reward out), as a user would write them for
`tokentape.integrations.openrlhf.agent_executor`."""

from __future__ import annotations

import json
from typing import Any

import openai

FEEDBACK = ("Are you sure? Answer again in one short sentence.", "Thank you. Say it once more, briefly.")
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def add_tool_result(arguments: str) -> str:
    """What the add tool answers to a call's arguments: the sum, or an error the model can read."""
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError):
        return "error: add takes two integers a and b"


async def _model(client: openai.AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def feedback_agent(client: openai.AsyncOpenAI, prompt: str, label: str) -> float:
    """Three greedy turns: the question, then two follow-ups; rewarded if the label was said."""
    model = await _model(client)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    said = ""
    for turn in range(len(FEEDBACK) + 1):
        reply = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=120, temperature=0, logprobs=True
        )
        said = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": said})
        if turn < len(FEEDBACK):
            messages.append({"role": "user", "content": FEEDBACK[turn]})
    return 1.0 if label.lower() in said.lower() else 0.0


async def tool_agent(client: openai.AsyncOpenAI, prompt: str, label: str) -> dict[str, Any]:
    """A tool loop: the model may call `add`; tool results go back until it answers, then one more
    question. Returns the reward with the number of tool calls it served."""
    model = await _model(client)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    tool_calls = 0
    answers = 0
    while answers < 2 and len(messages) < 12:
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=[ADD_TOOL], max_tokens=48, temperature=0.8, logprobs=True
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                tool_calls += 1
                result = add_tool_result(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            continue
        answers += 1
        messages.append({"role": "user", "content": "And what is that plus one?"})
    text = " ".join(str(m.get("content") or "") for m in messages if m["role"] == "assistant")
    return {"reward": 1.0 if label in text else 0.0, "extra_logs": {"tool_calls": tool_calls}}


async def sibling_agent(client: openai.AsyncOpenAI, prompt: str, label: str) -> float:
    """Two drafts (n=2), then a follow-up on the second: the episode's last turn is on that branch."""
    model = await _model(client)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    drafts = await client.chat.completions.create(
        model=model, messages=messages, n=2, max_tokens=16, temperature=1.0, seed=7, logprobs=True
    )
    chosen = drafts.choices[1].message.content or ""
    messages += [{"role": "assistant", "content": chosen}, {"role": "user", "content": "Shorter, please."}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, logprobs=True)
    return 1.0

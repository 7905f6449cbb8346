"""Tool calls and reasoning through the HTTP app and the openai SDK, on Qwen3's real tokenizer and
template (a scripted engine stands in for the model): non-streamed and streamed replies, and the
agent's echo of them continuing the same branch."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.models import materialise
from tests.support.served import build
from tokentape.engines.scripted import ScriptedEngine
from tokentape.runtime import hf_renderer

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]
CALL = (
    "<think>\nI should use the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
)
ANSWER = "<think>\nThe tool said 5.\n</think>\n\nThe sum is 5."


@pytest.fixture
async def qwen(tmp_path: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, ScriptedEngine, httpx.AsyncClient]]:
    renderer = hf_renderer(materialise("qwen3", tmp_path))
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = ScriptedEngine([], end)
    app = build(engine, renderer, model="qwen3").app
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        sdk = openai.AsyncOpenAI(base_url="http://t/sessions/agent/v1", api_key="x", http_client=http)
        engine.push([*renderer.tokenizer.encode(CALL), end])
        engine.push([*renderer.tokenizer.encode(ANSWER), end])
        yield sdk, engine, http


async def test_tool_call_round_trip(qwen: tuple[openai.AsyncOpenAI, ScriptedEngine, httpx.AsyncClient]) -> None:
    sdk, _, http = qwen
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 3?"}]
    first = await sdk.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert (choice.message.model_extra or {})["reasoning_content"] == "I should use the tool."
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    # the agent echoes the call with its own serialisation and adds the tool result
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    second = await sdk.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "The sum is 5."
    head = (first.model_extra or {})["prompt_token_ids"] + (choice.model_extra or {})["token_ids"]
    assert (second.model_extra or {})["prompt_token_ids"][: len(head)] == head
    summary = (await http.get("/sessions/agent")).json()
    assert (summary["turns"], summary["branches"], summary["rewrites"]) == (2, 1, 0)


async def test_streamed_tool_calls_and_reasoning(
    qwen: tuple[openai.AsyncOpenAI, ScriptedEngine, httpx.AsyncClient],
) -> None:
    sdk, _, _ = qwen
    stream = await sdk.chat.completions.create(
        model="qwen3", messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=TOOLS, stream=True
    )
    reasoning, content, calls, finish = "", "", [], None
    async for chunk in stream:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert reasoning == "I should use the tool."
    assert content == ""
    assert finish == "tool_calls"
    (call,) = calls
    assert call.index == 0 and call.function is not None and call.function.name == "add"
    assert json.loads(call.function.arguments or "") == {"a": 2, "b": 3}

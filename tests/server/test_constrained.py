"""tool_choice and response_format are enforced on the embedded model (llama.cpp grammars), every
constrained turn is flagged in the export, and an engine that cannot constrain answers 400."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.store.sqlite import SqliteStore

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD: Any = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ASK: Any = [{"role": "user", "content": "What is the weather like in Paris today?"}]


async def _export(http: httpx.AsyncClient, session: str) -> dict[str, Any]:
    (branch,) = (await http.get(f"/sessions/{session}/export")).json()["branches"]
    return dict(branch)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_tool_choice_required_makes_a_valid_call(
    sdk: openai.AsyncOpenAI, http: httpx.AsyncClient, temperature: float
) -> None:
    """Without a constraint SmolLM2 answers this in prose; "required" makes it call a tool. At
    temperature 1 the model may draw a string argument past `max_tokens` (the grammar lets a string
    run on): such a draw is cut off as `length`, and the next seed is drawn until a call completes."""
    for attempt in range(8):
        session = f"required-{attempt}"
        reply = await sdk.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            tools=[WEATHER, ADD],
            tool_choice="required",
            temperature=temperature,
            seed=5 + attempt,
            max_tokens=80,
            extra_body={"session_id": session},
        )
        choice = reply.choices[0]
        if choice.finish_reason != "length":
            break
        assert temperature > 0, "a greedy draw is the same on every seed"
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert isinstance(arguments["city"], str)
    else:
        assert call.function.name == "add" and all(isinstance(arguments[k], int) for k in "ab")
    branch = await _export(http, session)
    assert branch["constrained"] == [True]
    assert branch["tokens"] == (reply.model_extra or {})["prompt_token_ids"] + (choice.model_extra or {})["token_ids"]


async def test_a_named_function_is_the_one_called(sdk: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    reply = await sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0,
        max_tokens=80,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "add"
    assert set(json.loads(call.function.arguments)) == {"a", "b"}


async def test_auto_is_not_constrained(sdk: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    reply = await sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="auto",
        temperature=0,
        max_tokens=8,
        extra_body={"session_id": "auto"},
    )
    assert reply.choices[0].finish_reason == "length"
    assert (await _export(http, "auto"))["constrained"] == [False]


async def test_a_json_schema_response_format_gives_valid_json(sdk: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = await sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        temperature=1.0,
        seed=11,
        max_tokens=100,
        logprobs=True,
        extra_body={"session_id": "json"},
    )
    person = json.loads(reply.choices[0].message.content or "")
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    branch = await _export(http, "json")
    assert branch["constrained"] == [True]
    sampled = [lp for lp in branch["logprobs"] if lp is not None]
    assert sampled == [entry.logprob for entry in reply.choices[0].logprobs.content or []]


async def test_json_object_mode(sdk: openai.AsyncOpenAI) -> None:
    reply = await sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


async def test_a_tool_choice_naming_an_unknown_function_is_rejected(
    sdk: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
            extra_body={"session_id": "unknown-function"},
        )
    assert caught.value.body["param"] == "tool_choice"  # type: ignore[index]
    assert (await http.get("/sessions")).json()["data"] == []


async def test_an_engine_that_cannot_constrain_answers_400(renderer: Renderer) -> None:
    """A stand-in engine (it enforces no constraint kind) in place of a remote one."""
    engine = ScriptedEngine([1, 2, 3], 2)
    app = build(engine, renderer, model="m").app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        for extra in ({"tools": [WEATHER], "tool_choice": "required"}, {"response_format": {"type": "json_object"}}):
            body = {"model": "m", "messages": ASK, "stream": True, "session_id": "s", **extra}
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, response.text
            assert "cannot constrain" in response.json()["error"]["message"]
        assert engine.calls == 0
        assert (await http.get("/sessions")).json()["data"] == []


async def test_tokens_as_token_ids_on_chat_and_completions(sdk: openai.AsyncOpenAI) -> None:
    chat = await sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    choice = chat.choices[0]
    content = choice.logprobs.content if choice.logprobs else None
    assert [e.token for e in content or []] == [f"token_id:{t}" for t in (choice.model_extra or {})["token_ids"]]
    assert all(top.token.startswith("token_id:") for e in content or [] for top in e.top_logprobs)
    completion = await sdk.completions.create(
        model=MODEL_NAME,
        prompt=[1, 4093, 198],
        max_tokens=4,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    logprobs = completion.choices[0].logprobs
    ids = (completion.choices[0].model_extra or {})["token_ids"]
    assert logprobs is not None and logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs or [] for key in top)


async def test_constrained_and_trace_ids_survive_a_restart(
    engine: LlamaCppEngine, renderer: Renderer, tmp_path: Path
) -> None:
    """Both are columns of the store: a new gateway over the same file exports them again, and a store
    written before the constrained column existed opens with every turn unconstrained."""
    path = tmp_path / "store.sqlite3"
    body = {"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 60}
    exports = []
    for attempt in range(2):
        built = build(engine, renderer, store=SqliteStore(path))
        app, registry = built.app, built.gateway.sessions
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            if attempt == 0:
                response = await http.post(
                    "/sessions/kept/v1/chat/completions", json=body, headers={"X-Session-ID": "trace-9"}
                )
                assert response.status_code == 200, response.text
                free = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, "session_id": "free"}
                assert (await http.post("/v1/chat/completions", json=free)).status_code == 200
            exports.append(await _export(http, "kept"))
        registry.store.close()
    assert exports[0]["constrained"] == exports[1]["constrained"] == [True]
    assert exports[0]["trace_ids"] == exports[1]["trace_ids"] == ["trace-9"]
    with sqlite3.connect(path) as db:  # as a store of an earlier version left it
        db.execute("ALTER TABLE turns DROP COLUMN constrained")
    reopened = SqliteStore(path)
    kept, free_tree = await reopened.load("kept"), await reopened.load("free")
    assert kept is not None and free_tree is not None
    assert [n.constrained for n in (*kept.nodes, *free_tree.nodes)] == [False, False]
    assert [n.trace_id for n in kept.nodes] == ["trace-9"]
    reopened.close()

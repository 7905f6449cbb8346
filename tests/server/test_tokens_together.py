"""Streamed, tokens that came from the engine together make one delta (`SampledToken.follows`), on
every dialect, with nothing lost, doubled or reordered; tokens that came alone each make their own.
The scripted engine (a test instrument) marks a pushed answer as come together, as a remote engine's
adapter marks the events of one read (tests/engines/test_remote.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer

WORDS = " one two three four five six seven"


@pytest.fixture
async def scripted(renderer: Renderer) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedEngine, list[int], int]]:
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = ScriptedEngine([], end)
    app = build(engine, renderer).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        yield http, engine, renderer.tokenizer.encode(WORDS), end


def _chat_chunks(body: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


async def _stream_chat(http: httpx.AsyncClient, session: str, **fields: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count."}], "stream": True, **fields}
    reply = await http.post(f"/sessions/{session}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return _chat_chunks(reply.text)


def _content(chunks: list[dict[str, Any]]) -> list[str]:
    return [
        c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
    ]


async def _sampled(http: httpx.AsyncClient, session: str) -> list[int]:
    (branch,) = (await http.get(f"/sessions/{session}/export")).json()["branches"]
    return [t for t, m in zip(branch["tokens"], branch["loss_mask"], strict=True) if m]


@pytest.mark.parametrize("together", [True, False], ids=["together", "alone"])
async def test_tokens_that_came_together_make_one_chunk(
    scripted: tuple[httpx.AsyncClient, ScriptedEngine, list[int], int], together: bool
) -> None:
    http, engine, words, end = scripted
    engine.push([*words, end], together=together)
    chunks = await _stream_chat(http, "s", logprobs=True)
    content = _content(chunks)
    assert "".join(content) == WORDS
    # together: one delta for the whole answer; alone: one a word (each word is one token here)
    assert len(content) == (1 if together else len(words)), content
    logprobs = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0].get("logprobs")
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert len(logprobs) == len(words) + 1  # the end of the turn included, in order, once each
    assert await _sampled(http, "s") == [*words, end]
    assert chunks[-1]["choices"] == [] or chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_stop_string_inside_tokens_that_came_together_cuts_there(
    scripted: tuple[httpx.AsyncClient, ScriptedEngine, list[int], int],
) -> None:
    http, engine, words, end = scripted
    engine.push([*words, end], together=True)
    chunks = await _stream_chat(http, "stop", stop=[" four"])
    assert "".join(_content(chunks)) == " one two three"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["stop"]
    sampled = await _sampled(http, "stop")
    assert sampled == words[: len(sampled)] and len(sampled) < len(words) + 1, "it stopped sampling at the stop"


async def test_max_tokens_inside_tokens_that_came_together_sends_what_was_sampled(
    scripted: tuple[httpx.AsyncClient, ScriptedEngine, list[int], int],
) -> None:
    http, engine, words, end = scripted
    engine.push([*words, end], together=True)
    chunks = await _stream_chat(http, "cut", max_tokens=3)
    assert "".join(_content(chunks)) == "".join(f" {w}" for w in WORDS.split()[:3])  # one token a word here
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == [
        "length"
    ]
    assert await _sampled(http, "cut") == words[:3]


@pytest.mark.parametrize("route", ["completions", "responses", "messages"])
async def test_every_dialect_streams_tokens_that_came_together_whole(
    scripted: tuple[httpx.AsyncClient, ScriptedEngine, list[int], int], route: str
) -> None:
    http, engine, words, end = scripted
    engine.push([*words, end], together=True)
    if route == "completions":
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": "Count:", "stream": True, "max_tokens": 20}
        path = "/sessions/d/v1/completions"
    elif route == "responses":
        body = {"model": MODEL_NAME, "input": "Count.", "stream": True}
        path = "/sessions/d/v1/responses"
    else:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count."}], "stream": True}
        body["max_tokens"] = 20
        path = "/sessions/d/v1/messages"
    reply = await http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    if route == "completions":
        pieces = [e["choices"][0]["text"] for e in events if e.get("choices") and e["choices"][0].get("text")]
    elif route == "responses":
        pieces = [e["delta"] for e in events if e.get("type") == "response.output_text.delta"]
    else:
        pieces = [e["delta"]["text"] for e in events if e.get("type") == "content_block_delta"]
    assert "".join(pieces) == WORDS
    assert len(pieces) == 1, pieces
    assert await _sampled(http, "d") == [*words, end]

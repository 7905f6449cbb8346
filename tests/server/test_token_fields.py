"""Every token field where its client reads it: each dialect's sampled tokens and logprobs read
through that dialect's own SDK (openai for chat, completions and Responses, anthropic for Messages,
plain HTTP for vLLM's token route) and compared with the session's export, which is built from the
tape and not from any response. The piece each entry spells is checked against the tokenizer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.render.tokenizer import Tokenizer
from tokentape.served import Served

HI = [{"role": "user", "content": "Name three colours."}]
LOGPROBS = "message.output_text.logprobs"


@pytest.fixture
async def asgi(built: Served) -> AsyncIterator[httpx2.AsyncClient]:
    """The app in-process, through the HTTP client the SDKs themselves use."""
    app = built.app
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://tokentape") as client:
        yield client


def _openai(asgi: httpx2.AsyncClient, session: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://tokentape/sessions/{session}/v1", api_key="unused", http_client=asgi, max_retries=0
    )


async def _sampled(asgi: httpx2.AsyncClient, session: str) -> tuple[list[int], list[float]]:
    """The one turn of a session as its export has it: the tokens under loss mask 1 and their logprobs."""
    (branch,) = (await asgi.get(f"/sessions/{session}/export")).json()["branches"]
    picked = [(t, lp) for t, lp, m in zip(branch["tokens"], branch["logprobs"], branch["loss_mask"], strict=True) if m]
    assert picked
    return [t for t, _ in picked], [lp for _, lp in picked]


def _piece(tokenizer: Tokenizer, token_id: int) -> list[int]:
    return list(tokenizer.token_bytes(token_id) or tokenizer.special_text(token_id).encode())


async def test_chat_logprobs_through_the_openai_sdk(asgi: httpx2.AsyncClient, tokenizer: Tokenizer) -> None:
    reply = await _openai(asgi, "chat").chat.completions.create(
        model=MODEL_NAME, messages=HI, max_tokens=12, temperature=0.7, seed=3, logprobs=True, top_logprobs=2
    )
    tokens, logprobs = await _sampled(asgi, "chat")
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [entry.logprob for entry in content] == logprobs
    assert [entry.bytes for entry in content] == [_piece(tokenizer, t) for t in tokens]
    assert (reply.choices[0].model_extra or {})["token_ids"] == tokens


async def test_completion_logprobs_through_the_openai_sdk(asgi: httpx2.AsyncClient, tokenizer: Tokenizer) -> None:
    reply = await _openai(asgi, "completion").completions.create(
        model=MODEL_NAME, prompt="Colours: red,", max_tokens=8, temperature=0.7, seed=3, logprobs=2
    )
    tokens, logprobs = await _sampled(asgi, "completion")
    fields = reply.choices[0].logprobs
    assert fields is not None and fields.tokens is not None
    assert fields.token_logprobs == logprobs
    assert [piece.encode() for piece in fields.tokens] == [bytes(_piece(tokenizer, t)) for t in tokens]


async def test_responses_logprobs_in_the_output_text_part(asgi: httpx2.AsyncClient, tokenizer: Tokenizer) -> None:
    """`output[i].content[j].logprobs`, where the SDK reads them (not only in a top-level field)."""
    response = await _openai(asgi, "responses").responses.create(
        model=MODEL_NAME, input="Name three colours.", max_output_tokens=12, temperature=0.7, include=[LOGPROBS]
    )
    tokens, logprobs = await _sampled(asgi, "responses")
    (message,) = [item for item in response.output if item.type == "message"]
    (part,) = message.content
    assert part.type == "output_text" and part.logprobs is not None
    assert [entry.logprob for entry in part.logprobs] == logprobs
    assert [entry.bytes for entry in part.logprobs] == [_piece(tokenizer, t) for t in tokens]


async def test_responses_logprobs_in_each_streamed_delta(asgi: httpx2.AsyncClient, tokenizer: Tokenizer) -> None:
    """Each `response.output_text.delta` carries the logprobs of the tokens that made its text; the
    finished part carries them all (a token that made no text, such as the end of turn, included)."""
    client = _openai(asgi, "responses-stream")
    pieces: list[tuple[str, list[Any]]] = []
    final: Any = None
    async with client.responses.stream(
        model=MODEL_NAME,
        input="Name three colours.",
        max_output_tokens=12,
        temperature=0.7,
        include=[LOGPROBS],
        top_logprobs=2,
    ) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                pieces.append((event.delta, event.logprobs))
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    tokens, logprobs = await _sampled(asgi, "responses-stream")
    streamed = [entry for _, entry_list in pieces for entry in entry_list]
    assert streamed and [e.logprob for e in streamed] == logprobs[: len(streamed)]
    assert [e.bytes for e in streamed] == [_piece(tokenizer, t) for t in tokens[: len(streamed)]]
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    for text, entries in pieces:  # a delta's text is what its tokens spell (whole characters)
        assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace").endswith(text) or not entries
    part = final.output[0].content[0]  # type: ignore[union-attr]
    assert [e.logprob for e in part.logprobs] == logprobs  # type: ignore[union-attr]


async def test_messages_logprobs_through_the_anthropic_sdk(asgi: httpx2.AsyncClient, tokenizer: Tokenizer) -> None:
    client = anthropic.AsyncAnthropic(
        base_url="http://tokentape/sessions/messages", api_key="unused", http_client=asgi, max_retries=0
    )
    message = await client.messages.create(
        model=MODEL_NAME,
        max_tokens=12,
        messages=[{"role": "user", "content": "Name three colours."}],
        extra_body={"temperature": 0.7, "seed": 3, "logprobs": True, "top_logprobs": 2},
    )
    tokens, logprobs = await _sampled(asgi, "messages")
    extra = message.model_extra or {}
    assert [entry["logprob"] for entry in extra["logprobs"]] == logprobs
    assert [entry["bytes"] for entry in extra["logprobs"]] == [_piece(tokenizer, t) for t in tokens]
    assert extra["token_ids"] == tokens


async def test_token_route_logprobs_over_http(http: httpx.AsyncClient) -> None:
    prompt = [1, 9690, 198]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0.7, "seed": 3, "logprobs": 1}}
    reply = (await http.post("/sessions/generate/inference/v1/generate", json=body)).json()
    (branch,) = (await http.get("/sessions/generate/export")).json()["branches"]
    masked = [(t, lp) for t, lp, m in zip(branch["tokens"], branch["logprobs"], branch["loss_mask"], strict=True) if m]
    (choice,) = reply["choices"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [lp for _, lp in masked]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t, _ in masked]


async def test_a_turn_is_named_by_its_id_and_tokens_point_at_it_by_index(renderer: Renderer) -> None:
    """On a branch through the second of two choices, the turn ids are not positions: each token's
    `turn_index` points into the branch's per-turn lists, whose `turn_ids` name the turns. The two
    choices are scripted, so they differ on any machine (a sampled pair may coincide)."""
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = ScriptedEngine([], end)
    for text in ("Hello there", "Good day", "Fine"):
        engine.push([*renderer.tokenizer.encode(text), end])
    app = build(engine, renderer).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        hi = [{"role": "user", "content": "Hi"}]
        base = {"model": MODEL_NAME, "max_tokens": 8}
        first = (await http.post("/sessions/named/v1/chat/completions", json={**base, "messages": hi, "n": 2})).json()
        assert [c["message"]["content"] for c in first["choices"]] == ["Hello there", "Good day"]
        follow = [*hi, {"role": "assistant", "content": "Good day"}, {"role": "user", "content": "More"}]
        assert (await http.post("/sessions/named/v1/chat/completions", json={**base, "messages": follow})).is_success
        export = (await http.get("/sessions/named/export")).json()
    assert export["schema_version"] == 2
    (longest,) = [b for b in export["branches"] if len(b["turn_ids"]) == 2]
    assert longest["turn_ids"] == [1, 2]  # choice 1 of the first request, then the follow-up
    assert "turns" not in longest
    for k, (start, end_) in enumerate(longest["action_ranges"]):
        assert set(longest["turn_index"][start:end_]) == {k}
    assert sorted(set(longest["turn_index"])) == [0, 1]

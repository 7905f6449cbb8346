"""Rewrites on a real engine: a chat template that drops earlier reasoning (as Qwen3's does) makes
the template's rendering diverge from the tape; each policy handles it as documented, and an edited
echo of a reply is handled the same way."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer
from tokentape.render.template import ChatTemplate
from tokentape.render.tokenizer import GGUFTokenizer

# ChatML that shows an assistant's reasoning only while it is the last message, and marks earlier
# replies: once a new message follows, the template's rendering of the reply no longer matches the tape.
STRIPPING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and message.reasoning_content and loop.last -%}"
    "{{ '<think>' + message.reasoning_content + '</think>' }}"
    "{%- endif -%}"
    "{%- if message.role == 'assistant' and not loop.last -%}{{ '(earlier) ' }}{%- endif -%}"
    "{{ message.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@pytest.fixture
async def stripping_http(engine: LlamaCppEngine, tokenizer: GGUFTokenizer) -> Any:
    renderer = Renderer(ChatTemplate(STRIPPING_TEMPLATE), tokenizer)
    app = build(engine, renderer).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        yield client


async def _turn(http: httpx.AsyncClient, session: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return await http.post(f"/sessions/{session}/v1/chat/completions", json=body)


async def _two_turns(http: httpx.AsyncClient, session: str, policy: str) -> tuple[dict[str, Any], httpx.Response]:
    created = await http.post("/sessions", json={"session_id": session, "rewrite_policy": policy})
    assert created.status_code == 201
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    first = (await _turn(http, session, messages)).json()
    reply = first["choices"][0]["message"]["content"]
    messages += [
        {"role": "assistant", "content": reply, "reasoning_content": "they greeted me"},
        {"role": "user", "content": "Bye"},
    ]
    return first, await _turn(http, session, messages)


async def test_tape_policy_keeps_the_tape_and_counts_the_rewrite(stripping_http: httpx.AsyncClient) -> None:
    first, second = await _two_turns(stripping_http, "t", "tape")
    assert second.status_code == 200
    head = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert second.json()["prompt_token_ids"][: len(head)] == head
    export = (await stripping_http.get("/sessions/t/export")).json()
    assert export["summary"]["rewrites"] == 1
    (branch,) = export["branches"]
    assert [r["kind"] for r in branch["rewrites"]] == ["template"]
    assert branch["rewrites"][0]["policy"] == "tape"


async def test_fork_policy_sends_the_templates_rendering_on_a_new_branch(stripping_http: httpx.AsyncClient) -> None:
    first, second = await _two_turns(stripping_http, "f", "fork")
    assert second.status_code == 200
    export = (await stripping_http.get("/sessions/f/export")).json()
    assert export["summary"]["rewrites"] == 1
    assert len(export["branches"]) == 2  # the first turn stays a branch of its own
    forked = next(b for b in export["branches"] if b["rewrites"])
    at = forked["rewrites"][0]["at_token"]
    shared = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert forked["tokens"][:at] == shared[:at]
    assert forked["tokens"][: len(second.json()["prompt_token_ids"])] == second.json()["prompt_token_ids"]
    assert at == len(first["prompt_token_ids"])  # the template changed the reply itself


async def test_strict_policy_rejects_and_records_nothing(stripping_http: httpx.AsyncClient) -> None:
    _, second = await _two_turns(stripping_http, "s", "strict")
    assert second.status_code == 409
    error = second.json()["error"]
    assert error["code"] == "rewrite_rejected" and "strict" in error["message"]
    summary = (await stripping_http.get("/sessions/s")).json()
    assert (summary["turns"], summary["rewrites"]) == (1, 0)


@pytest.mark.parametrize("policy", ["tape", "fork", "strict"])
async def test_an_edited_reply_follows_the_policy(http: httpx.AsyncClient, policy: str) -> None:
    await http.post("/sessions", json={"session_id": "e", "rewrite_policy": policy})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    await _turn(http, "e", messages)
    messages += [{"role": "assistant", "content": "I am a different reply."}, {"role": "user", "content": "Ok"}]
    response = await _turn(http, "e", messages)
    summary = (await http.get("/sessions/e")).json()
    if policy == "strict":
        assert response.status_code == 409
        assert (summary["turns"], summary["rewrites"]) == (1, 0)
    else:
        assert response.status_code == 200
        assert (summary["turns"], summary["rewrites"]) == (2, 1)
        assert summary["rewrite_events"][0]["kind"] == "assistant_edited"
        assert summary["branches"] == (1 if policy == "tape" else 2)


async def test_an_edit_deep_in_a_longer_history_is_seen(http: httpx.AsyncClient) -> None:
    """The first reply's echo is edited three turns later, its length kept: the session must see the
    edit at message 1, not take the history for the one it recorded."""
    await http.post("/sessions", json={"session_id": "d", "rewrite_policy": "tape"})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    for question in ("Why?", "And then?", "Ok"):
        reply = (await _turn(http, "d", messages)).json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    assert (await http.get("/sessions/d")).json()["rewrites"] == 0
    first = messages[1]["content"]
    assert first.swapcase() != first
    edited = [*messages[:1], {"role": "assistant", "content": first.swapcase()}, *messages[2:]]
    assert (await _turn(http, "d", edited)).status_code == 200
    summary = (await http.get("/sessions/d")).json()
    assert (summary["turns"], summary["rewrites"]) == (4, 1)
    assert (summary["rewrite_events"][0]["kind"], summary["rewrite_events"][0]["at_message"]) == ("assistant_edited", 1)

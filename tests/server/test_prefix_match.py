"""Prefix matching: calls that name no session continue the one live session whose history they
extend; identical histories in several sessions, or an edited one, open a new session and say so."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import MODEL_NAME
from tokentape.client import InProcessGateway
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer
from tokentape.served import Served, ServeSpec, build_served

HEADER = "x-tokentape-prefix-match"


@pytest.fixture
async def local(engine: LlamaCppEngine, renderer: Renderer) -> AsyncIterator[InProcessGateway]:
    spec = ServeSpec(served_model_name=MODEL_NAME, match_prefix=True)
    client = InProcessGateway(served=build_served(spec, engine=engine, renderer=renderer))
    yield client
    await client.aclose()


async def _call(local: InProcessGateway, messages: list[dict[str, Any]], **fields: Any) -> tuple[str, str, Any]:
    """(prefix-match header, session id, the parsed reply) of one unnamed call."""
    fields = {"max_tokens": 6, "temperature": 0, **fields}
    raw = await local.client().chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages, **fields)
    return raw.headers.get(HEADER, ""), raw.headers["x-session-id"], raw.parse()


def _echo(reply: Any, index: int = 0) -> dict[str, Any]:
    return {"role": "assistant", "content": reply.choices[index].message.content}


async def test_distinct_episodes_each_continue_their_own_session(local: InProcessGateway) -> None:
    first: dict[str, tuple[str, Any, list[dict[str, Any]]]] = {}
    for topic in ("cats", "the sea"):
        messages = [{"role": "user", "content": f"Say one word about {topic}."}]
        header, session, reply = await _call(local, messages)
        assert header == "new"
        first[topic] = (session, reply, messages)
    assert first["cats"][0] != first["the sea"][0]
    for session, reply, messages in first.values():
        follow = [*messages, _echo(reply), {"role": "user", "content": "And another?"}]
        header, continued, second = await _call(local, follow)
        assert (header, continued) == ("matched", session)
        # the second prompt is the first prompt, the sampled tokens as sampled, then the bridge
        recorded = reply.prompt_token_ids + reply.choices[0].token_ids
        assert second.prompt_token_ids[: len(recorded)] == recorded
        (branch,) = (await local.export(session))["branches"]
        assert branch["tokens"] == second.prompt_token_ids + second.choices[0].token_ids
        assert len(branch["turn_ids"]) == 2


async def test_identical_episodes_are_ambiguous_and_open_a_new_session(local: InProcessGateway) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    # one greedy token: the same reply in both (longer greedy replies can drift with llama.cpp's cache reuse)
    _, one, reply_one = await _call(local, messages, max_tokens=1)
    _, two, reply_two = await _call(local, messages, max_tokens=1)
    assert one != two and reply_one.choices[0].token_ids == reply_two.choices[0].token_ids
    follow = [*messages, _echo(reply_one), {"role": "user", "content": "Another one?"}]
    header, session, _ = await _call(local, follow)
    assert header == "ambiguous" and session not in (one, two)
    for untouched in (one, two):
        assert (await local.export(untouched))["summary"]["turns"] == 1


async def test_an_edited_history_is_unmatched_and_opens_a_new_session(local: InProcessGateway) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    _, first, reply = await _call(local, messages)
    edited = {"role": "assistant", "content": (reply.choices[0].message.content or "") + " (edited)"}
    header, session, _ = await _call(local, [*messages, edited, {"role": "user", "content": "Why?"}])
    assert header == "unmatched" and session != first
    assert (await local.export(first))["summary"]["turns"] == 1


async def test_siblings_of_one_request_continue_in_that_session(local: InProcessGateway) -> None:
    messages = [{"role": "user", "content": "Write a short greeting."}]
    for seed in range(11, 31):  # the case needs two different siblings: draw until a seed gives them
        raw = await local.client().chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=messages, max_tokens=8, temperature=1.0, seed=seed, n=2
        )
        session, reply = raw.headers["x-session-id"], raw.parse()
        if reply.choices[0].message.content != reply.choices[1].message.content:
            break
    else:
        raise AssertionError("20 seeds gave identical siblings at temperature 1: seeds do not reach the engine")
    header, continued, _ = await _call(local, [*messages, _echo(reply, 1), {"role": "user", "content": "Thanks"}])
    assert (header, continued) == ("matched", session)
    export = await local.export(session)
    assert export["summary"]["branches"] == 2
    extended = next(b for b in export["branches"] if len(b["turn_ids"]) == 2)
    assert extended["tokens"][: len(reply.prompt_token_ids)] == reply.prompt_token_ids
    sibling = reply.choices[1].token_ids
    start = len(reply.prompt_token_ids)
    assert extended["tokens"][start : start + len(sibling)] == sibling  # the choice the echo named


async def test_finished_sessions_are_not_continued(local: InProcessGateway) -> None:
    messages = [{"role": "user", "content": "Name a planet."}]
    _, first, reply = await _call(local, messages)
    await local.finish(first, reward=1.0)
    header, session, _ = await _call(local, [*messages, _echo(reply), {"role": "user", "content": "Another?"}])
    assert header == "unmatched" and session != first


async def test_without_the_option_every_unnamed_call_is_its_own_session(built: Served) -> None:
    local = InProcessGateway(served=built)
    try:
        messages = [{"role": "user", "content": "Name a tree."}]
        raw = await local.client().chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0
        )
        reply = raw.parse()
        again = await local.client().chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[*messages, _echo(reply), {"role": "user", "content": "Another?"}], max_tokens=4
        )
        assert HEADER not in again.headers and again.headers["x-session-id"] != raw.headers["x-session-id"]
    finally:
        await local.aclose()

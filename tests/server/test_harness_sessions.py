"""An agent harness's own id names its session, and its side calls go to sessions of their own.

Claude Code sends `X-Claude-Code-Session-Id` (and a `session_id` inside `metadata.user_id`), Codex
a `session_id` header and `prompt_cache_key`: one harness run is one session with nothing to set.
A harness's titles, quota probes and subagents are not its episode: a call without tools, or one
whose first message differs from the episode's, lands in `{id}.side-{head}`, in the episode's group,
marked `side_of`, and out of the episode's export. The engine is a scripted one: what is asserted is
where calls land, not what the model says.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.core.episodes import episode_head, side_session_id
from tokentape.engines.scripted import ScriptedEngine
from tokentape.errors import InvalidRequest
from tokentape.gateway.service import Gateway
from tokentape.render.renderer import Renderer, RenderOptions
from tokentape.server.session_names import Named, named_session

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
SYSTEM = {"role": "system", "content": "You are a coding agent."}


def _chat(*messages: dict[str, Any], tools: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": list(messages), "max_tokens": 4, **extra}
    if tools:
        body["tools"] = TOOLS
    return body


@pytest.fixture
async def served(renderer: Renderer) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    built = build(ScriptedEngine(renderer.tokenizer.encode("Done."), end), renderer)
    gateway, app = built.gateway, built.app
    await gateway.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        yield gateway, http
    await gateway.aclose()


# -- the reading, pure ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "headers", "body", "expected"),
    [
        ("p", {"x-session-id": "h", "x-claude-code-session-id": "c"}, {"session_id": "b"}, Named("p", "path", "h")),
        (None, {"x-session-id": "h", "x-claude-code-session-id": "c"}, None, Named("h", "header")),
        (None, {"x-claude-code-session-id": "c"}, {"session_id": "b"}, Named("b", "body")),
        (
            None,
            {"x-claude-code-session-id": "c", "session_id": "x"},
            None,
            Named("c", "harness", harness="claude-code"),
        ),
        (None, {"session_id": "x"}, {"prompt_cache_key": "k"}, Named("x", "harness", harness="codex")),
        (None, {"session-id": "y"}, None, Named("y", "harness", harness="codex")),
        (None, {}, {"prompt_cache_key": "k"}, Named("k", "harness", harness="codex")),
        (
            None,
            {},
            {"metadata": {"user_id": json.dumps({"session_id": "u1"})}},
            Named("u1", "harness", harness="claude-code"),
        ),
        (None, {}, {"metadata": {"user_id": "not json"}}, Named(None)),
        (None, {"x-claude-code-session-id": "bad id"}, {"prompt_cache_key": "a/b"}, Named(None)),  # not ids: no name
        (None, {}, None, Named(None)),
    ],
)
def test_one_precedence_names_the_session(
    path: str | None, headers: dict[str, str], body: dict[str, Any] | None, expected: Named
) -> None:
    assert named_session(path, headers, body) == expected


def test_a_header_and_body_that_disagree_are_refused_and_an_explicit_bad_name_is_too() -> None:
    with pytest.raises(InvalidRequest):
        named_session(None, {"x-session-id": "a"}, {"session_id": "b"})
    with pytest.raises(InvalidRequest):
        named_session(None, {"x-session-id": "a b"}, None)


# -- served ----------------------------------------------------------------------------------------
async def test_claude_codes_header_makes_one_session_of_its_turns(served: tuple[Gateway, httpx.AsyncClient]) -> None:
    _, http = served
    headers = {"X-Claude-Code-Session-Id": "3f2a9c1e-claude"}
    first = await http.post(
        "/v1/chat/completions", json=_chat(SYSTEM, {"role": "user", "content": "ls"}), headers=headers
    )
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]
    history = [SYSTEM, {"role": "user", "content": "ls"}, {"role": "assistant", "content": reply["content"]}]
    second = await http.post(
        "/v1/chat/completions", json=_chat(*history, {"role": "user", "content": "and now?"}), headers=headers
    )
    assert second.status_code == 200, second.text
    assert first.headers["x-session-id"] == second.headers["x-session-id"] == "3f2a9c1e-claude"
    summary = (await http.get("/sessions/3f2a9c1e-claude")).json()
    assert (summary["turns"], summary["branches"], summary["rewrites"]) == (2, 1, 0)
    assert summary["metadata"]["harness"] == "claude-code"


async def test_codexs_prompt_cache_key_and_header_name_its_session(served: tuple[Gateway, httpx.AsyncClient]) -> None:
    _, http = served
    by_key = await http.post(
        "/v1/chat/completions", json=_chat(SYSTEM, {"role": "user", "content": "hi"}, prompt_cache_key="thread-1")
    )
    by_header = await http.post(
        "/v1/chat/completions",
        json=_chat(SYSTEM, {"role": "user", "content": "yo"}),
        headers={"session_id": "thread-2"},
    )
    assert (by_key.headers["x-session-id"], by_header.headers["x-session-id"]) == ("thread-1", "thread-2")


async def test_an_explicit_name_wins_over_the_harness_id(served: tuple[Gateway, httpx.AsyncClient]) -> None:
    _, http = served
    body = _chat(SYSTEM, {"role": "user", "content": "hi"})
    headers = {"X-Claude-Code-Session-Id": "harness-own"}
    in_path = await http.post("/sessions/run-1/v1/chat/completions", json=body, headers=headers)
    in_header = await http.post("/v1/chat/completions", json=body, headers={**headers, "X-Session-ID": "run-2"})
    assert (in_path.headers["x-session-id"], in_header.headers["x-session-id"]) == ("run-1", "run-2")
    assert (await http.get("/sessions/harness-own")).status_code == 404


async def test_side_calls_land_in_their_own_sessions_of_the_episodes_group(
    served: tuple[Gateway, httpx.AsyncClient],
) -> None:
    _, http = served
    headers = {"X-Claude-Code-Session-Id": "ep"}
    title = {"role": "system", "content": "Write a 5-word title for this conversation."}
    user = {"role": "user", "content": "fix the tests"}
    # the title call races ahead of the episode's first call: it is told apart by carrying no tools
    side = await http.post("/v1/chat/completions", json=_chat(title, user, tools=False), headers=headers)
    episode = await http.post("/v1/chat/completions", json=_chat(SYSTEM, user), headers=headers)
    # a subagent: tools, but a system prompt of its own
    sub = {"role": "system", "content": "You are a search subagent."}
    subagent = await http.post("/v1/chat/completions", json=_chat(sub, user), headers=headers)
    for response in (side, episode, subagent):
        assert response.status_code == 200, response.text
    title_id = side_session_id("ep", episode_head([title, user]))
    sub_id = side_session_id("ep", episode_head([sub, user]))
    assert (side.headers["x-session-id"], episode.headers["x-session-id"], subagent.headers["x-session-id"]) == (
        title_id,
        "ep",
        sub_id,
    )
    assert title_id != sub_id and title_id.startswith("ep.side-")
    for sid in (title_id, sub_id):
        summary = (await http.get(f"/sessions/{sid}")).json()
        assert (summary["group_id"], summary["metadata"]["side_of"], summary["turns"]) == ("ep", "ep", 1)
    episode_summary = (await http.get("/sessions/ep")).json()
    assert (episode_summary["turns"], episode_summary["branches"]) == (1, 1)  # no fork of the episode
    # exports leave side calls out unless asked
    listed = (await http.get("/export")).json()["data"]
    assert {row["session_id"] for row in listed} == {"ep"}
    only = (await http.get("/export", params={"side_calls": "only"})).json()["data"]
    assert {row["session_id"] for row in only} == {title_id, sub_id}
    everything = (await http.get("/export", params={"side_calls": "true"})).json()["data"]
    assert {row["session_id"] for row in everything} == {"ep", title_id, sub_id}
    assert (await http.get("/export", params={"side_calls": "maybe"})).status_code == 400
    # finishing the episode finishes its side calls
    assert (await http.post("/sessions/ep/finish", json={"metadata": {"exit_status": 0}})).status_code == 200
    for sid in (title_id, sub_id):
        assert (await http.get(f"/sessions/{sid}")).json()["finished"] is True


async def test_a_plain_named_session_keeps_every_call(served: tuple[Gateway, httpx.AsyncClient]) -> None:
    """Without a harness, a call without tools or with another system prompt is the session's, as before."""
    _, http = served
    headers = {"X-Session-ID": "plain"}
    user = {"role": "user", "content": "hi"}
    await http.post("/v1/chat/completions", json=_chat(SYSTEM, user), headers=headers)
    await http.post(
        "/v1/chat/completions", json=_chat({"role": "system", "content": "Other."}, user, tools=False), headers=headers
    )
    summary = (await http.get("/sessions/plain")).json()
    assert summary["branches"] == 2
    assert [s["session_id"] for s in (await http.get("/sessions")).json()["data"]] == ["plain"]


async def test_a_session_opened_for_a_harness_sorts_its_calls_under_its_base_url(
    served: tuple[Gateway, httpx.AsyncClient],
) -> None:
    """`tokentape run` opens the session with metadata `harness`: calls under its base URL are sorted."""
    _, http = served
    created = await http.post("/sessions", json={"session_id": "run-7", "metadata": {"harness": "opencode"}})
    assert created.status_code == 201, created.text
    user = {"role": "user", "content": "hi"}
    title = await http.post(
        "/sessions/run-7/v1/chat/completions", json=_chat({"role": "system", "content": "Title it."}, user, tools=False)
    )
    assert title.headers["x-session-id"].startswith("run-7.side-")
    episode = await http.post("/sessions/run-7/v1/chat/completions", json=_chat(SYSTEM, user))
    assert episode.headers["x-session-id"] == "run-7"


async def test_opencodes_title_call_racing_its_first_turn_is_a_side_call(
    served: tuple[Gateway, httpx.AsyncClient],
) -> None:
    """opencode names its session with X-Session-ID and is known by its User-Agent; its title call,
    sent with the same id alongside the first turn, carries no tools."""
    _, http = served
    headers = {
        "X-Session-ID": "ses_abc",
        "User-Agent": "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14",
    }
    user = {"role": "user", "content": "fix it"}
    title_system = {"role": "system", "content": "You are a title generator."}
    title, first = await asyncio.gather(
        http.post("/v1/chat/completions", json=_chat(title_system, user, tools=False), headers=headers),
        http.post("/v1/chat/completions", json=_chat(SYSTEM, user), headers=headers),
    )
    assert first.headers["x-session-id"] == "ses_abc"
    assert title.headers["x-session-id"] == side_session_id("ses_abc", episode_head([title_system]))
    assert (await http.get("/sessions/ses_abc")).json()["branches"] == 1


async def test_a_compacted_history_is_a_new_branch_of_the_episode_rendered_whole(
    served: tuple[Gateway, httpx.AsyncClient], renderer: Renderer
) -> None:
    """Auto-compaction (Claude Code's, Codex's) replaces the history with a summary: no recorded reply
    is in it, so it is a fresh branch of the episode's session, its prompt the template's rendering
    of what was sent (computed here by the renderer, independently of the session), and the
    earlier branch stays as it was."""
    _, http = served
    headers = {"X-Claude-Code-Session-Id": "compacted"}
    user = {"role": "user", "content": "fix the build"}
    first = await http.post("/v1/chat/completions", json=_chat(SYSTEM, user), headers=headers)
    reply = {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}
    await http.post(
        "/v1/chat/completions", json=_chat(SYSTEM, user, reply, {"role": "user", "content": "go on"}), headers=headers
    )
    compacted = [
        SYSTEM,
        {"role": "user", "content": "Summary: the build was fixed."},
        {"role": "user", "content": "next"},
    ]
    after = await http.post("/v1/chat/completions", json=_chat(*compacted), headers=headers)
    assert after.headers["x-session-id"] == "compacted"
    exported = (await http.get("/sessions/compacted/export")).json()
    assert len(exported["branches"]) == 2
    assert (await http.get("/sessions/compacted")).json()["rewrites"] == 0
    newest = max(exported["branches"], key=lambda b: max(b["turn_ids"]))
    expected = list(renderer.prompt(compacted, RenderOptions(tools=TOOLS)).tokens)
    sampled = [t for t, m in zip(newest["tokens"], newest["loss_mask"], strict=True) if m]
    assert newest["tokens"][: len(expected)] == expected
    assert newest["tokens"][len(expected) :] == sampled  # the rest is what the engine sampled

"""Memory is bounded in bytes, not only in sessions: past the budget the least recently used sessions
leave memory (their turns stay in the store and come back on use), a finished session leaves once it
is written, and when the running sessions alone hold the budget a new request gets 429 with
Retry-After instead of the process growing. A scripted engine answers, so sizes are exact."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.core.session import BYTES_PER_TOKEN
from tokentape.core.tape import TurnNode
from tokentape.engines.remote.wire import wire_ids
from tokentape.engines.scripted import ScriptedEngine
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import REPLAY_RECORD_BYTES, UNNAMED_RECORD_BYTES, MemoryLimits, SessionRegistry
from tokentape.render.renderer import Renderer
from tokentape.store.sqlite import SqliteStore


async def _open(
    renderer: Renderer, tmp_path: Path, max_bytes: int
) -> tuple[Gateway, SessionRegistry, httpx.AsyncClient]:
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = ScriptedEngine(renderer.tokenizer.encode("Fine, thanks."), end)
    built = build(engine, renderer, store=SqliteStore(tmp_path / "m.db"), memory=MemoryLimits(max_bytes=max_bytes))
    gateway, app = built.gateway, built.app
    await gateway.start()
    return gateway, gateway.sessions, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _turn(text: str) -> dict[str, object]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 8}


@pytest.fixture
async def small(
    renderer: Renderer, tmp_path: Path
) -> AsyncIterator[tuple[Gateway, SessionRegistry, httpx.AsyncClient]]:
    """A budget of about three one-turn sessions."""
    gateway, registry, http = await _open(renderer, tmp_path, 0)
    async with http:
        assert (await http.post("/sessions/probe/v1/chat/completions", json=_turn("Hello there"))).is_success
        one = registry.held_bytes  # what one such session holds, as counted
        assert one >= BYTES_PER_TOKEN * 10
        registry.limits = MemoryLimits(max_bytes=3 * one + one // 2)
        yield gateway, registry, http
    await gateway.aclose()


async def test_past_the_budget_the_least_recent_leave_memory_and_come_back(
    small: tuple[Gateway, SessionRegistry, httpx.AsyncClient],
) -> None:
    _, registry, http = small
    for n in range(8):
        answer = await http.post(f"/sessions/s{n}/v1/chat/completions", json=_turn("Hello there"))
        assert answer.status_code == 200, answer.text
        assert registry.held_bytes <= registry.limits.max_bytes
    assert len(registry) <= 3
    assert registry.in_memory("s0") is None and registry.in_memory("s7") is not None
    # what left memory is whole in the store: the session extends from where it was
    export = (await http.get("/sessions/s0/export")).json()
    (branch,) = export["branches"]
    follow = {**_turn("Hello there"), "messages": [{"role": "user", "content": "Hello there"}]}
    follow["messages"] += [{"role": "assistant", "content": "Fine, thanks."}, {"role": "user", "content": "More?"}]
    assert (await http.post("/sessions/s0/v1/chat/completions", json=follow)).status_code == 200
    (longer,) = (await http.get("/sessions/s0/export")).json()["branches"]
    assert longer["tokens"][: len(branch["tokens"])] == branch["tokens"]
    assert registry.held_bytes <= registry.limits.max_bytes


async def test_a_finished_session_leaves_memory_once_written(
    small: tuple[Gateway, SessionRegistry, httpx.AsyncClient],
) -> None:
    _, registry, http = small
    await http.post("/sessions/done/v1/chat/completions", json=_turn("Hello there"))
    assert registry.in_memory("done") is not None
    finished = await http.post("/sessions/done/finish", json={"metadata": {"task": "t1"}})
    assert finished.status_code == 200, finished.text
    assert registry.in_memory("done") is None
    export = (await http.get("/sessions/done/export")).json()  # served from the store
    assert export["summary"]["finished"] is True and export["summary"]["metadata"] == {"task": "t1"}
    assert len(export["branches"]) == 1


def _turn_nodes() -> int:
    return sum(isinstance(o, TurnNode) for o in gc.get_objects())


async def test_a_finished_sessions_turns_are_freed_at_once_not_by_the_cycle_collector(
    small: tuple[Gateway, SessionRegistry, httpx.AsyncClient],
) -> None:
    """A serving process runs the cycle collector rarely (`server.heap`): turns kept alive by a
    reference cycle would pile up, tokens and all, long after their sessions left memory."""
    _, registry, http = small
    history = _turn("Hello there")["messages"]
    later = [*history, {"role": "assistant", "content": "Fine, thanks."}, {"role": "user", "content": "More?"}]
    for messages in (history, later, later, history):  # a branch beside the first path, and a sibling
        answer = await http.post("/sessions/done/v1/chat/completions", json={**_turn(""), "messages": messages})
        assert answer.status_code == 200, answer.text
    session = registry.in_memory("done")
    assert session is not None
    turns = len(session.tree.nodes)
    assert turns >= 3 and len(session.tree.leaves) >= 2
    del session
    gc.collect()
    gc.disable()
    try:
        before = _turn_nodes()
        assert (await http.post("/sessions/done/finish", json={})).status_code == 200
        assert registry.in_memory("done") is None
        assert _turn_nodes() == before - turns
    finally:
        gc.enable()


async def test_when_running_sessions_hold_the_budget_new_work_waits(
    small: tuple[Gateway, SessionRegistry, httpx.AsyncClient],
) -> None:
    _, registry, http = small
    await http.post("/sessions/busy/v1/chat/completions", json=_turn("Hello there"))
    busy = registry.in_memory("busy")
    assert busy is not None
    busy.in_flight += 1  # as if its next request were running: it cannot leave memory
    registry.limits = MemoryLimits(max_bytes=1)
    refused = await http.post("/sessions/other/v1/chat/completions", json=_turn("Hello there"))
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert "budget" in refused.json()["error"]["message"]
    assert (await http.get("/sessions/other/export")).status_code == 404  # nothing recorded
    busy.in_flight -= 1
    registry.limits = MemoryLimits()
    assert (await http.post("/sessions/other/v1/chat/completions", json=_turn("Hello there"))).status_code == 200


async def test_retry_records_count_toward_the_budget(renderer: Renderer, tmp_path: Path) -> None:
    """A session's retry records (its latest request per retry key) are part of what it holds, and
    so is the registry's record of the session each unnamed request opened."""
    gateway, registry, http = await _open(renderer, tmp_path, 1 << 30)
    async with http:
        for text in ("Hello there", "Hello again"):
            assert (await http.post("/sessions/keys/v1/chat/completions", json=_turn(text))).status_code == 200
        session = registry.in_memory("keys")
        assert session is not None and len(session.latest) == 2
        assert session.held_bytes == session.tree.held_bytes + 2 * REPLAY_RECORD_BYTES
        assert registry.held_bytes == session.held_bytes
        assert (await http.post("/v1/chat/completions", json=_turn("Who are you?"))).status_code == 200
        unnamed = [s for s in registry._sessions.values() if s.id != "keys"]
        assert len(unnamed) == 1
        expected = session.held_bytes + unnamed[0].held_bytes + UNNAMED_RECORD_BYTES
        assert registry.held_bytes == expected
    await gateway.aclose()


async def test_unnamed_retry_records_are_bounded_by_the_budget(renderer: Renderer, tmp_path: Path) -> None:
    gateway, registry, http = await _open(renderer, tmp_path, 1 << 30)
    async with http:
        registry.limits = MemoryLimits(max_bytes=64 * 3 * UNNAMED_RECORD_BYTES)  # room for three records
        for n in range(5):
            assert (await http.post("/v1/chat/completions", json=_turn(f"Hello {n}"))).status_code == 200
        assert len(registry._unnamed) == 3
    await gateway.aclose()


class _Remote(ScriptedEngine):
    """Writes each prompt's IDs as a remote engine's body does, before the turn is recorded."""

    def generate(self, prompt: Any, params: Any, **options: Any) -> Any:
        orjson.dumps({"prompt": wire_ids(prompt, to_engine=True)})
        return super().generate(prompt, params, **options)


async def test_past_the_budget_kept_prompt_texts_go_before_any_session(renderer: Renderer, tmp_path: Path) -> None:
    """Each session keeps the JSON text of the latest prompt it sent the engine; the text counts against
    the budget, and at the budget those texts are dropped, least recently used first, before any
    session leaves memory. The next prompt is then written whole, and true."""
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = _Remote(renderer.tokenizer.encode("Fine, thanks."), end)
    built = build(engine, renderer, store=SqliteStore(tmp_path / "m.db"), memory=MemoryLimits(max_bytes=1 << 30))
    gateway, app, registry = built.gateway, built.app, built.gateway.sessions
    await gateway.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        histories = {}
        for n in range(4):
            history = [{"role": "user", "content": f"Hello there, number {n}. " * 30}]
            body = {**_turn(""), "messages": history}
            answer = (await http.post(f"/sessions/t{n}/v1/chat/completions", json=body)).json()
            histories[n] = [*history, answer["choices"][0]["message"], {"role": "user", "content": "More?"}]
            answer = await http.post(f"/sessions/t{n}/v1/chat/completions", json={**body, "messages": histories[n]})
            assert answer.status_code == 200, answer.text
        sessions = [registry.in_memory(f"t{n}") for n in range(4)]
        texts = [s.tree.prompt_text.held_bytes for s in sessions if s is not None]
        assert len(texts) == 4 and all(texts)
        held = registry.held_bytes
        assert held == sum(s.held_bytes for s in sessions if s is not None)  # the texts counted as made
        registry.limits = MemoryLimits(max_bytes=held - texts[0] - texts[1] // 2)  # two texts must go
        registry.account(sessions[3])  # type: ignore[arg-type]  # as after a turn
        assert registry.evicted == 0 and len(registry) == 4
        assert [s.tree.prompt_text.held_bytes for s in sessions if s is not None] == [0, 0, *texts[2:]]
        assert registry.held_bytes == held - texts[0] - texts[1] <= registry.limits.max_bytes
        again = await http.post("/sessions/t0/v1/chat/completions", json={**_turn(""), "messages": histories[0]})
        shown = again.json()["prompt_token_ids"]
        branches = (await http.get("/sessions/t0/export")).json()["branches"]
        assert any(branch["tokens"][: len(shown)] == shown for branch in branches)
    await gateway.aclose()

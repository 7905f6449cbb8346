"""A real `tokentape serve` in front of several engines speaking vLLM's and SGLang's formats:
exactness through each adapter, session-affine least-loaded routing, failover, drain, and pause /
resume with policy versions."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.fake_engines import FakeState, SwappableApp, serving, sglang_app, vllm_app
from tests.support.scenarios import five_turn_scenario
from tokentape.launcher import RunningServer, running_server


@pytest.fixture(scope="module")
def engine_servers() -> Iterator[list[tuple[SwappableApp, str]]]:
    currents = [SwappableApp(), SwappableApp(), SwappableApp()]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serving(c, lifespan="off")) for c in currents]
        yield list(zip(currents, urls, strict=True))


@pytest.fixture
def pool(
    engine_servers: list[tuple[SwappableApp, str]],
) -> Iterator[tuple[RunningServer, list[tuple[str, FakeState]]]]:
    states = [FakeState(), FakeState(), FakeState()]
    for (current, _), app, state in zip(engine_servers, (vllm_app, vllm_app, sglang_app), states, strict=True):
        current.app = app(state)
    a, b, c = (url for _, url in engine_servers)
    specs = [f"vllm={a}", f"vllm-generate={b}", f"sglang={c}"]
    args = [arg for spec in specs for arg in ("--engine", spec)]
    with running_server(args) as server:
        yield server, list(zip([a, b, c], states, strict=True))


def _client(server: RunningServer, session: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.session_url(session), api_key="x", max_retries=0)


def _engine_of(states: list[tuple[str, FakeState]], session: str) -> list[int]:
    return [i for i, (_, state) in enumerate(states) if session in state.session_headers]


async def test_each_adapter_keeps_the_tape_exact(pool: tuple[RunningServer, list[tuple[str, FakeState]]]) -> None:
    server, states = pool
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    assert model == "fake-model"
    for _, state in states:  # slow enough that the three first turns are in flight together
        state.delay = 0.01
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        # three sessions at once: least-loaded placement spreads them over the three engines
        await asyncio.gather(*(five_turn_scenario(_client(server, f"x{i}"), model, http, f"x{i}") for i in range(3)))
        exports = [(await http.get(f"/sessions/x{i}/export")).json() for i in range(3)]
    placements = [_engine_of(states, f"x{i}") for i in range(3)]
    assert all(len(p) == 1 for p in placements), placements  # every turn of a session on one engine
    assert sorted(p[0] for p in placements) == [0, 1, 2]
    # what each engine was sent, as its own wire format names it, is the tape up to a turn's start
    branches = [branch["tokens"] for export in exports for branch in export["branches"]]
    for _, state in states:
        for body in state.requests:
            sent = body.get("prompt") or body.get("token_ids") or body.get("input_ids")
            assert isinstance(sent, list) and sent and all(type(t) is int for t in sent)
            assert any(tokens[: len(sent)] == sent and len(tokens) > len(sent) for tokens in branches)


async def _turn(server: RunningServer, session: str, messages: list[Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        response = await http.post(
            f"/sessions/{session}/v1/chat/completions",
            json={"model": "fake-model", "messages": messages, "max_tokens": 20},
        )
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data


async def test_failover_moves_a_session_and_keeps_its_tape(
    pool: tuple[RunningServer, list[tuple[str, FakeState]]],
) -> None:
    server, states = pool
    messages: list[Any] = [{"role": "user", "content": "Hello"}]
    first = await _turn(server, "f", messages)
    (home,) = _engine_of(states, "f")
    states[home][1].fail_next = 5  # its engine dies
    states[home][1].healthy = False
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Still there?"},
    ]
    second = await _turn(server, "f", messages)
    assert len(_engine_of(states, "f")) == 2  # moved
    head = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert second["prompt_token_ids"][: len(head)] == head
    engines = httpx.get(f"{server.base_url}/admin/engines").json()["data"]
    assert [e["healthy"] for e in engines].count(False) == 1


async def test_drain_sends_new_sessions_elsewhere(pool: tuple[RunningServer, list[tuple[str, FakeState]]]) -> None:
    server, states = pool
    drained_url = states[0][0]
    listed = httpx.post(f"{server.base_url}/admin/engines", json={"drain": drained_url}).json()["data"]
    assert len(listed) == 3 and [e["draining"] for e in listed if e["url"] == drained_url] == [True]
    for i in range(4):
        await _turn(server, f"d{i}", [{"role": "user", "content": f"Hi {i}"}])
    assert all(0 not in _engine_of(states, f"d{i}") for i in range(4))
    await asyncio.sleep(0.2)
    urls = [e["url"] for e in httpx.get(f"{server.base_url}/admin/engines").json()["data"]]
    assert drained_url not in urls


async def test_pause_holds_and_resume_labels_the_policy_version(
    pool: tuple[RunningServer, list[tuple[str, FakeState]]],
) -> None:
    server, _ = pool
    await _turn(server, "p", [{"role": "user", "content": "Before"}])
    assert httpx.post(f"{server.base_url}/admin/pause", json={}).json()["paused"] is True
    waiting = asyncio.create_task(_turn(server, "q", [{"role": "user", "content": "During"}]))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # held, not rejected
    resumed = httpx.post(f"{server.base_url}/admin/resume", json={"policy_version": 7}).json()
    assert (resumed["paused"], resumed["policy_version"]) == (False, "7")
    await waiting
    (before,) = httpx.get(f"{server.base_url}/sessions/p/export").json()["branches"]
    (after,) = httpx.get(f"{server.base_url}/sessions/q/export").json()["branches"]
    assert (before["policy_versions"], after["policy_versions"]) == ([None], ["7"])
    for fmt in ("tokentape", "openrlhf", "verifiers"):
        rows = httpx.get(f"{server.base_url}/export", params={"format": fmt}).json()["data"]
        assert {r["session_id"]: r["policy_versions"] for r in rows}["q"] == ["7"]


async def test_pause_with_abort_stops_running_streams(
    pool: tuple[RunningServer, list[tuple[str, FakeState]]],
) -> None:
    server, states = pool
    for _, state in states:
        state.delay = 0.2  # slow tokens: the generation is still running when the pause comes
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "Go"}], "max_tokens": 20, "stream": True}

    async def stream() -> tuple[list[int], list[str]]:
        tokens, finishes = [], []
        async with (
            httpx.AsyncClient(base_url=server.base_url, timeout=60) as http,
            http.stream("POST", "/sessions/a/v1/chat/completions", json=body) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        tokens += choice.get("token_ids") or []
                        finishes += [choice["finish_reason"]] if choice.get("finish_reason") else []
        return tokens, finishes

    running = asyncio.create_task(stream())
    await asyncio.sleep(0.7)
    httpx.post(f"{server.base_url}/admin/pause", json={"abort": True})
    tokens, finishes = await asyncio.wait_for(running, timeout=10)
    assert finishes == ["abort"] and 0 < len(tokens) < 13  # cut before the script's 13 tokens
    httpx.post(f"{server.base_url}/admin/resume", json={})
    (branch,) = httpx.get(f"{server.base_url}/sessions/a/export").json()["branches"]
    assert branch["finish_reasons"] == ["abort"]
    assert [t for t, m in zip(branch["tokens"], branch["loss_mask"], strict=True) if m] == tokens


async def test_pause_with_abort_withdraws_unstreamed_answers_and_runs_them_again(
    pool: tuple[RunningServer, list[tuple[str, FakeState]]],
) -> None:
    # a client that did not ask for a stream has seen nothing of its answer: it is not cut short, it
    # waits for the new weights and gets a whole answer sampled by them
    server, states = pool
    for _, state in states:
        state.delay = 0.2  # 13 tokens: 2.6 s an answer, so the pause comes while all three run
    running = [asyncio.create_task(_turn(server, f"w{i}", [{"role": "user", "content": "Go"}])) for i in range(3)]
    await asyncio.sleep(0.7)
    # least-loaded placement put one on each engine: vLLM completions, vLLM's token route, SGLang
    assert [len(state.requests) for _, state in states] == [1, 1, 1]
    assert all(state.requests[0]["stream"] is False for _, state in states)  # each asked for one piece
    assert httpx.post(f"{server.base_url}/admin/pause", json={"abort": True}).json()["paused"] is True
    await asyncio.sleep(0.5)
    assert not any(task.done() for task in running)  # held, not cut short
    # vLLM's stand-ins count a client that left; SGLang's counts its /abort_request
    assert [state.aborted for _, state in states] == [1, 1, 1]
    httpx.post(f"{server.base_url}/admin/resume", json={"policy_version": 9})
    replies = await asyncio.wait_for(asyncio.gather(*running), timeout=20)
    assert [len(state.requests) for _, state in states] == [2, 2, 2]
    for i, reply in enumerate(replies):
        assert reply["choices"][0]["finish_reason"] == "stop"
        (branch,) = httpx.get(f"{server.base_url}/sessions/w{i}/export").json()["branches"]
        assert branch["finish_reasons"] == ["stop"] and branch["policy_versions"] == ["9"]
        sampled = [t for t, m in zip(branch["tokens"], branch["loss_mask"], strict=True) if m]
        assert sampled == reply["choices"][0]["token_ids"] and len(sampled) == 13


async def test_each_turn_records_its_engines_logprob_mode(
    pool: tuple[RunningServer, list[tuple[str, FakeState]]],
) -> None:
    server, states = pool
    # vLLM at its default (raw_logprobs) reports raw values at temperature 0.5; SGLang scales them
    for _, state in states:
        state.delay = 0.05  # the three overlap, so least-loaded placement puts one on each engine

    async def turn(i: int) -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            response = await http.post(
                f"/sessions/m{i}/v1/chat/completions",
                json={
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": f"Mode {i}"}],
                    "max_tokens": 5,
                    "temperature": 0.5,
                },
            )
            assert response.status_code == 200, response.text

    await asyncio.gather(*(turn(i) for i in range(3)))
    assert sorted(_engine_of(states, f"m{i}")[0] for i in range(3)) == [0, 1, 2]
    for i in range(3):
        (home,) = _engine_of(states, f"m{i}")
        export = httpx.get(f"{server.base_url}/sessions/m{i}/export").json()
        expected = "temperature_scaled_untruncated" if home == 2 else "raw"  # engine 2 is the SGLang one
        assert export["branches"][0]["logprob_modes"] == [expected]
        assert export["logprob_mode"] == expected


def test_no_healthy_engine_is_503_with_retry_after() -> None:
    state = FakeState(healthy=False)
    with serving(vllm_app(state)) as url, running_server(["--engine", f"vllm={url}"]) as server:
        state.fail_next = 10
        response = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
            timeout=30,
        )
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) >= 1
        assert "no healthy engine" in response.json()["error"]["message"]

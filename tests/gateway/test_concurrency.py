"""Concurrent calls on one session: each lands as its own turn, and each branch holds exactly what
its call was served; requests that arrive together let what is ready run before they are planned."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tokentape.core.sampling import SamplingParams
from tokentape.core.session import SessionTree
from tokentape.gateway.calls import ChatCall, ChoiceDone, Event
from tokentape.gateway.planning import Plan
from tokentape.gateway.service import Gateway


async def _call(http: httpx.AsyncClient, messages: list[dict[str, Any]], seed: int, stream: bool) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": seed}
    if not stream:
        data = (await http.post("/sessions/busy/v1/chat/completions", json=body)).json()
        return {"prompt": data["prompt_token_ids"], "ids": data["choices"][0]["token_ids"]}
    prompt: list[int] = []
    ids: list[int] = []
    async with http.stream("POST", "/sessions/busy/v1/chat/completions", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                prompt = chunk.get("prompt_token_ids", prompt)
                for choice in chunk["choices"]:
                    ids += choice["token_ids"]
    return {"prompt": prompt, "ids": ids}


async def test_parallel_calls_on_one_session_become_separate_exact_turns(http: httpx.AsyncClient) -> None:
    first = await _call(http, [{"role": "user", "content": "Hi"}], 0, False)
    text = (await http.post("/detokenize", json={"tokens": first["ids"]})).json()["prompt"]
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}]
    calls = await asyncio.gather(
        *(
            _call(http, [*history, {"role": "user", "content": f"Question {i}"}], i, stream=i % 2 == 0)
            for i in range(6)
        ),
        _call(http, [{"role": "user", "content": "Unrelated"}], 9, False),
    )
    export = (await http.get("/sessions/busy/export")).json()
    assert export["summary"]["turns"] == 8
    branches = [b["tokens"] for b in export["branches"]]
    for call in calls:
        whole = call["prompt"] + call["ids"]
        assert whole in branches
    head = first["prompt"] + first["ids"]
    assert all(call["prompt"][: len(head)] == head for call in calls[:6])


async def test_a_request_lets_what_is_ready_run_before_it_is_planned(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that arrive together are not each planned and sent in one step while answers already
    back wait behind them: a request gives the loop a turn once it is admitted, before its planning.
    The session is in memory (its second request), so nothing else on the way suspends."""
    call = ChatCall(
        messages=[{"role": "user", "content": "Hi"}],
        sampling=SamplingParams(max_tokens=2, temperature=0.0),
        session_id="together",
    )
    assert [e async for e in gateway.run(call, streamed=False) if isinstance(e, ChoiceDone)]
    order: list[str] = []
    plan = gateway.planner.chat

    async def planned(tree: SessionTree, call: ChatCall, *rest: Any) -> Plan:
        order.append("planned")
        return await plan(tree, call, *rest)

    monkeypatch.setattr(gateway.planner, "chat", planned)

    async def again() -> list[Event]:
        return [event async for event in gateway.run(call, streamed=False)]

    request = asyncio.create_task(again())
    asyncio.get_running_loop().call_soon(order.append, "ready before it")  # queued just after its first step
    assert any(isinstance(event, ChoiceDone) for event in await request)
    assert order == ["ready before it", "planned"]

"""Concurrent calls on one session: each lands as its own turn, and each branch holds exactly what
its call was served."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.conftest import MODEL_NAME


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

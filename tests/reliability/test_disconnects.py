"""Clients that leave, against a real `tokentape serve`: generation stops within a token or two and
the turn is kept with what was sampled (finish reason "abort")."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tokentape.launcher import RunningServer

STORY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
    "max_tokens": 400,
    "temperature": 1.0,
    "seed": 7,
    "stop_token_ids": [],
}


@pytest.fixture
def server(shared_server: RunningServer) -> RunningServer:
    return shared_server


def _generated(server: RunningServer) -> int:
    count: int = httpx.get(f"{server.base_url}/health").json()["tokens_generated"]
    return count


async def _settled(server: RunningServer) -> int:
    """Tokens generated once generation has stopped (no change over half a second)."""
    last = _generated(server)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = _generated(server)
        if now == last:
            return now
        last = now
    raise AssertionError("generation did not stop")


async def test_a_streaming_client_that_leaves(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        before = _generated(server)
        chunks = 0
        async with http.stream(
            "POST", "/sessions/left-stream/v1/chat/completions", json={**STORY, "stream": True}
        ) as response:
            async for line in response.aiter_lines():
                chunks += line.startswith("data: {")
                if chunks == 5:
                    break
        generated = await _settled(server) - before
        (branch,) = (await http.get("/sessions/left-stream/export")).json()["branches"]
    assert branch["finish_reasons"] == ["abort"]
    assert sum(branch["loss_mask"]) == generated  # every sampled token is on the tape
    assert generated < 40  # stopped within a few tokens of the 5th chunk, not at max_tokens


async def test_a_waiting_client_that_leaves(server: RunningServer) -> None:
    before = _generated(server)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=0.8) as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post("/sessions/left-wait/v1/chat/completions", json=STORY)
    generated = await _settled(server) - before
    (branch,) = httpx.get(f"{server.base_url}/sessions/left-wait/export").json()["branches"]
    assert branch["finish_reasons"] == ["abort"]
    assert sum(branch["loss_mask"]) == generated
    assert generated < 300

"""Through `tokentape serve` (uvicorn, the real openai SDK, streamed and not): updates land while
several turns run; every turn ends as one reply at max_tokens, what each client received is what was
recorded, and the recorded spans show turns that went on across updates under the new versions."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tokentape.launcher import RunningServer, running_server

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(adapters: list[Path]) -> Iterator[RunningServer]:
    # serve loads weights only from the directories it is told (its cache and ./runs by default)
    with running_server(["--context-length", "2048", "--weights-dir", str(adapters[0].parent)]) as running:
        yield running


async def test_turns_go_on_across_updates_on_a_served_gateway(server: RunningServer, adapters: list[Path]) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        # the first update waits for a streamed turn's first token, so it lands while turns run
        # whatever the machine's speed (on a busy machine the turns can start after a timed series)
        generating = asyncio.Event()

        async def turn(name: str, streamed: bool) -> list[int]:
            sdk = openai.AsyncOpenAI(base_url=f"{server.base_url}/sessions/{name}/v1", api_key="x", max_retries=0)
            request = {
                "model": model,
                "messages": [{"role": "user", "content": f"{name}: write a long story about a harbour."}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "logprobs": True,
            }
            ids: list[int] = []
            if streamed:
                finishes = []
                async for chunk in await sdk.chat.completions.create(**request, stream=True):
                    for choice in chunk.choices:
                        finishes.append(choice.finish_reason)
                        for item in choice.logprobs.content or [] if choice.logprobs else []:
                            ids.append(int(item.model_extra["token_id"]))  # type: ignore[index]
                            generating.set()
                assert [f for f in finishes if f] == ["length"]
            else:
                reply = await sdk.chat.completions.create(**request)
                assert reply.choices[0].finish_reason == "length"
                content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
                ids = [int(item.model_extra["token_id"]) for item in content or []]  # type: ignore[index]
            await sdk.close()
            return ids

        async def trainer() -> None:
            await generating.wait()
            for version in range(1, 6):
                if version > 1:
                    await asyncio.sleep(0.4)
                body = {"version": version, "lora": str(adapters[version % 3])}
                answer = await http.post("/admin/weights", json=body)
                assert answer.status_code == 200, answer.text

        names = [f"served-{i}" for i in range(3)]
        results = await asyncio.gather(trainer(), *(turn(n, i % 2 == 0) for i, n in enumerate(names)))
        seams = 0
        for name, received in zip(names, results[1:], strict=True):
            assert len(received) == MAX_TOKENS
            (branch,) = (await http.get(f"/sessions/{name}/export")).json()["branches"]
            (start, end) = branch["action_ranges"][0]
            assert branch["tokens"][start:end] == received  # one turn, exactly what the client got
            spans = branch["policy_spans"][0]
            assert spans[0]["start"] == 0 and spans[-1]["end"] == MAX_TOKENS
            assert all(a["end"] == b["start"] and a["version"] < b["version"] for a, b in itertools.pairwise(spans))
            seams += len(spans) - 1
        assert seams > 0
        assert (await http.get("/admin/status")).json()["weights_version"] == 5

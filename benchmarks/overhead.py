"""Gateway overhead: requests/s and added latency of going through tokentape versus calling the engine
directly, with an instant scripted engine behind a real HTTP server on loopback (speaking vLLM's
/v1/completions format), at 1, 16 and 64 concurrent sessions; and memory per recorded token.

Each session runs a multi-turn chat through `tokentape serve --engine vllm=...` (render, bridge,
route, record to the store); the direct path sends the same-sized token prompts straight to the
engine. Everything runs on this machine, so the figures are relative: read the ratio.

    python benchmarks/overhead.py [--turns 5] [--levels 1 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.fake_engines import FakeState, serving, vllm_app

from tokentape.launcher import running_server


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def through_gateway(base: str, sessions: int, turns: int, tag: str) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=200)) as http:

        async def session(i: int) -> None:
            messages: list[dict[str, Any]] = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Question {turn} of session {i}: what next?"})
                start = time.perf_counter()
                response = await http.post(
                    f"/sessions/{tag}-{i}/v1/chat/completions",
                    json={"model": "fake-model", "messages": messages, "max_tokens": 32},
                )
                latencies.append(time.perf_counter() - start)
                assert response.status_code == 200, response.text
                messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})

        await asyncio.gather(*(session(i) for i in range(sessions)))
    return latencies


async def direct(engine: str, sessions: int, turns: int) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=engine, timeout=120, limits=httpx.Limits(max_connections=200)) as http:

        async def session(i: int) -> None:
            prompt = list(range(1000, 1040 + i))
            for _ in range(turns):
                start = time.perf_counter()
                async with http.stream(
                    "POST",
                    "/v1/completions",
                    json={
                        "model": "fake-model",
                        "prompt": prompt,
                        "max_tokens": 32,
                        "stream": True,
                        "logprobs": 0,
                        "return_token_ids": True,
                    },
                ) as response:
                    ids: list[int] = []
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            ids += httpx.Response(200, content=line[6:]).json()["choices"][0]["token_ids"]
                latencies.append(time.perf_counter() - start)
                prompt = prompt + ids + list(range(2000, 2020))

        await asyncio.gather(*(session(i) for i in range(sessions)))
    return latencies


def _row(level: int, label: str, latencies: list[float], elapsed: float) -> str:
    p50 = statistics.median(latencies) * 1e3
    p99 = statistics.quantiles(latencies, n=100)[98] * 1e3 if len(latencies) > 1 else p50
    return f"{level:>8} {label:>10} {len(latencies) / elapsed:>10.1f} {p50:>9.2f} {p99:>9.2f}"


async def main(args: argparse.Namespace) -> None:
    state = FakeState()
    with (
        serving(vllm_app(state)) as engine,
        running_server(["--engine", f"vllm={engine}", "--store", ":memory:"]) as server,
    ):
        await through_gateway(server.base_url, 2, 2, "warmup")
        print(f"{'sessions':>8} {'path':>10} {'req/s':>10} {'p50 ms':>9} {'p99 ms':>9}")
        for level in args.levels:
            start = time.perf_counter()
            ours = await through_gateway(server.base_url, level, args.turns, f"c{level}")
            ours_elapsed = time.perf_counter() - start
            start = time.perf_counter()
            theirs = await direct(engine, level, args.turns)
            theirs_elapsed = time.perf_counter() - start
            print(_row(level, "tokentape", ours, ours_elapsed))
            print(_row(level, "direct", theirs, theirs_elapsed))
            added = (statistics.median(ours) - statistics.median(theirs)) * 1e3
            print(
                f"{'':>8} {'added':>10} {'':>10} {added:>9.2f}   (req/s ratio "
                f"{(len(ours) / ours_elapsed) / (len(theirs) / theirs_elapsed):.2f})"
            )
        # memory per recorded token: record many more turns and compare the server's RSS
        before = _rss_kb(server.process.pid)
        tokens_before = sum(s["tokens"] for s in httpx.get(f"{server.base_url}/sessions").json()["data"])
        await through_gateway(server.base_url, 64, 10, "memory")
        after = _rss_kb(server.process.pid)
        tokens_after = sum(s["tokens"] for s in httpx.get(f"{server.base_url}/sessions").json()["data"])
        recorded = tokens_after - tokens_before
        print(
            f"\nmemory: {recorded:,} tokens recorded, RSS +{(after - before) / 1024:.1f} MB, "
            f"{(after - before) * 1024 / max(1, recorded):.0f} bytes per recorded token"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    asyncio.run(main(parser.parse_args()))

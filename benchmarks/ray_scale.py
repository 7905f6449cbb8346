"""tokentape on Ray: requests/s with 1, 2 and 4 gateway actors, the cost of reaching a session's
owner through another gateway, per-gateway memory, and what a SIGKILLed engine actor costs.

An instant scripted engine speaking vLLM's format (a test instrument, in this process) stands in
for the GPU engines; each session is an agent of 4 turns talking to its owner's base URL. All of
it shares this machine's cores, so read the figures as relative. Ray stays on loopback: run as
`make bench` does (inside a network namespace with only `lo`).

    python benchmarks/ray_scale.py [--sessions 32] [--turns 4] [--gateways 1 2 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.ray.conftest import free_port_block
from tests.support.fake_engines import FakeState, serving, vllm_app

from tokentape.ray import RayOptions, ServeSpec, connect, start_cluster

MODEL = "smollm2-135m-instruct"


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _agents(bases: list[str], turns: int, *, header_at: str | None = None) -> list[float]:
    """Each base URL is one session's agent; with `header_at`, every call goes to that gateway and
    names its session by header instead (so most reach their owner through Ray)."""
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as http:

        async def agent(base: str) -> None:
            messages: list[dict[str, Any]] = []
            session = base.split("/sessions/")[1].split("/")[0]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Step {turn}: what next?"})
                url, headers = f"{base}/chat/completions", {}
                if header_at is not None:
                    url, headers = f"{header_at}/v1/chat/completions", {"X-Session-ID": session}
                started = time.perf_counter()
                reply = await http.post(
                    url, headers=headers, json={"model": MODEL, "messages": messages, "max_tokens": 16}
                )
                latencies.append(time.perf_counter() - started)
                reply.raise_for_status()
                messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})

        await asyncio.gather(*(agent(base) for base in bases))
    return latencies


def _sessions(front_or_gateway: str, prefix: str, count: int) -> list[str]:
    return [
        httpx.post(f"{front_or_gateway}/sessions", json={"session_id": f"{prefix}-{i}"}).json()["base_url"]
        for i in range(count)
    ]


def scale(engine_url: str, gateways: int, sessions: int, turns: int, store_dir: str) -> dict[str, Any]:
    first = free_port_block(gateways + 1)
    cluster = start_cluster(
        ServeSpec(
            engines=(f"vllm={engine_url}",),
            served_model_name=MODEL,
            port=first,  # gateway i serves on first + 1 + i
            ray=RayOptions(gateways=gateways, store_dir=store_dir),
        )
    )
    try:
        urls = cluster.gateway_urls
        bases = _sessions(urls[0], f"g{gateways}", sessions)
        asyncio.run(_agents(bases[:2], 1))  # warm the connections
        started = time.perf_counter()
        latencies = asyncio.run(_agents(bases, turns))
        elapsed = time.perf_counter() - started
        row: dict[str, Any] = {
            "gateways": gateways,
            "req_s": len(latencies) / elapsed,
            "p50_ms": statistics.median(latencies) * 1000,
            "rss_mb": statistics.mean(_rss_mb(g["pid"]) for g in cluster.describe()),
        }
        if gateways >= 2:  # the same agents, every call sent to gateway 0 and named by header
            hop = asyncio.run(_agents(_sessions(urls[0], f"hop{gateways}", sessions), turns, header_at=urls[0]))
            row["via_other_p50_ms"] = statistics.median(hop) * 1000
        return row
    finally:
        cluster.stop()


def engine_death(store_dir: str, turns_after: int = 3) -> dict[str, Any]:
    """Two embedded engine actors, four agents; one engine actor is SIGKILLed mid-traffic."""
    first = free_port_block(3)
    cluster = start_cluster(
        ServeSpec(
            context_length=2048,
            threads=1,
            port=first,  # gateway i serves on first + 1 + i
            ray=RayOptions(gateways=2, store_dir=store_dir, engine_actors=2),
        )
    )
    failures = 0
    done_after: dict[str, int] = {}
    try:
        bases = _sessions(cluster.gateway_urls[0], "death", 4)
        killed_at = 0.0

        async def agent(base: str, http: httpx.AsyncClient) -> None:
            nonlocal failures
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me."}]
            while done_after.get(base, 0) < turns_after:
                reply = await http.post(
                    f"{base}/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
                )
                if reply.status_code != 200:
                    failures += 1
                    await asyncio.sleep(0.2)
                    continue
                messages += [
                    {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Go on."},
                ]
                if killed_at:
                    done_after[base] = done_after.get(base, 0) + 1

        async def run() -> float:
            nonlocal killed_at
            async with httpx.AsyncClient(timeout=120) as http:
                tasks = [asyncio.create_task(agent(base, http)) for base in bases]
                await asyncio.sleep(4)
                pid = ray.get(cluster.engines[0].__ray_call__.remote(lambda self: os.getpid()))
                os.kill(pid, signal.SIGKILL)
                killed_at = time.perf_counter()
                await asyncio.gather(*tasks)
                return time.perf_counter() - killed_at

        recovered = asyncio.run(run())
        engines = ray.get(cluster.registry.describe.remote())
        return {"failed_requests": failures, "seconds_to_3_turns_each": recovered, "moves": engines["moves"]}
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    connect("local", num_cpus=os.cpu_count())
    with serving(vllm_app(FakeState())) as engine, tempfile.TemporaryDirectory() as shards:
        rows = [scale(engine, n, args.sessions, args.turns, f"{shards}/{n}") for n in args.gateways]
    print(f"\ntokentape on Ray, {args.sessions} sessions x {args.turns} turns, instant engine, {os.cpu_count()} cores")
    print(f"{'gateways':>8} {'req/s':>8} {'p50 ms':>8} {'via other gw p50 ms':>20} {'RSS/gateway MB':>15}")
    for row in rows:
        via = f"{row['via_other_p50_ms']:.1f}" if "via_other_p50_ms" in row else "-"
        print(f"{row['gateways']:>8} {row['req_s']:>8.1f} {row['p50_ms']:>8.1f} {via:>20} {row['rss_mb']:>15.0f}")
    with tempfile.TemporaryDirectory() as shards:
        death = engine_death(shards)
    print(
        f"\nengine actor SIGKILLed under 4 agents: {death['failed_requests']} failed requests (retried by the "
        f"agents), {death['seconds_to_3_turns_each']:.1f} s until every agent had 3 more turns; "
        f"sessions moved to the other engine: {death['moves']}"
    )
    ray.shutdown()


if __name__ == "__main__":
    main()

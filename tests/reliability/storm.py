"""Abandon-and-retry storm: many clients start requests, give up on them at random points (before the
answer, mid-stream) and resend them as the openai SDK does, against a real `tokentape serve` in front of
a vLLM-format engine (the local stand-in of tests/support/fake_engines.py, with slow tokens so that
requests are abandoned mid-generation). Afterwards the gateway must still answer, the engine must be
healthy, and the gateway must hold no more sockets to the engine than before (counted in /proc).
Also measures how many new TCP connections the gateway opens to the engine per completed request."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.fake_engines import FakeState, serving, vllm_app
from tokentape.launcher import RunningServer, running_server

Figures = dict[str, Any]
TCP_STATES = {"01": "established", "08": "close_wait", "06": "time_wait", "04": "fin_wait1", "05": "fin_wait2"}


def sockets_to(pid: int, port: int) -> dict[str, int]:
    """Sockets process `pid` holds to 127.0.0.1:`port`, by TCP state (from /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    counts: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                remote, state, inode = fields[2], fields[3], fields[9]
                if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == port:
                    name = TCP_STATES.get(state, state)
                    counts[name] = counts.get(name, 0) + 1
    return counts


@contextlib.contextmanager
def gateway_over_fake_vllm(
    token_delay: float, kind: str = "vllm", engine_keep_alive: int = 5
) -> Iterator[tuple[RunningServer, FakeState, int]]:
    """`engine_keep_alive`: seconds the engine keeps an idle connection (uvicorn's, as vLLM's server)."""
    state = FakeState(delay=token_delay)
    engine = serving(vllm_app(state), timeout_keep_alive=engine_keep_alive)
    with engine as url, running_server(["--engine", f"{kind}={url}"]) as server:
        yield server, state, int(url.rsplit(":", 1)[1])


def _body(i: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": f"question {i}"}],
        "max_tokens": 10,
        "stream": stream,
    }


async def _abandon_once(
    client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str], rng: random.Random
) -> bool:
    """Start the request and give up on it at a random point. True if it was abandoned unfinished."""
    patience = rng.uniform(0.0, 0.12)
    if body["stream"]:

        async def read_some() -> bool:
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                wanted = rng.randint(0, 3)
                seen = 0
                async for _ in response.aiter_raw():
                    seen += 1
                    if seen > wanted:
                        return True  # leaves the block with the body unread: the connection is dropped
            return False

        try:
            return await asyncio.wait_for(read_some(), patience)
        except (TimeoutError, httpx.HTTPError):
            return True
    try:
        await asyncio.wait_for(client.post("/v1/chat/completions", json=body, headers=headers), patience)
        return False
    except (TimeoutError, httpx.HTTPError):
        return True


async def abandon_storm(server: RunningServer, *, abandoned: int, clients: int, seed: int = 0) -> Figures:
    """Run until `abandoned` requests were given up; every abandoned request is resent (retry count 1,
    like the SDK), and the resend is itself abandoned half the time."""
    done = {"abandoned": 0, "completed": 0, "resent": 0, "errors_5xx": 0, "timeouts": 0}

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            i = 0
            while done["abandoned"] < abandoned:
                i += 1
                body = _body(index * 1_000_000 + i, stream=rng.random() < 0.5)
                if await _abandon_once(client, body, {}, rng):
                    done["abandoned"] += 1
                else:
                    done["completed"] += 1
                    continue
                done["resent"] += 1
                retry = {"x-stainless-retry-count": "1"}
                if rng.random() < 0.5 and await _abandon_once(client, body, retry, rng):
                    done["abandoned"] += 1
                    continue
                try:
                    response = await client.post("/v1/chat/completions", json={**body, "stream": False}, headers=retry)
                except httpx.TimeoutException:
                    done["timeouts"] += 1  # a resent request the gateway did not answer within a minute
                    continue
                if response.status_code >= 500:
                    done["errors_5xx"] += 1
                done["completed"] += 1

    started = time.monotonic()
    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return {**done, "clients": clients, "seconds": round(time.monotonic() - started, 1)}


async def connections_per_request(server: RunningServer, state: FakeState, *, requests: int, concurrency: int) -> float:
    """New TCP connections the gateway opened to the engine per completed request (the engine counts
    the distinct client ports it sees)."""
    before = len(state.peers)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with semaphore:
                response = await client.post("/v1/chat/completions", json=_body(-i, stream=False))
                response.raise_for_status()

        await asyncio.gather(*(one(i) for i in range(requests)))
    return (len(state.peers) - before) / requests


async def settled_sockets(server: RunningServer, pid: int, port: int, engine_keep_alive: int) -> dict[str, int]:
    """Sockets to the engine once idle connections had time to expire: wait past the engine's keep-alive
    limit (it closes its idle connections, and the gateway closes its side when it reads their end), make
    one request (the pool also drops connections past its own expiry when it is next used), count."""
    await asyncio.sleep(engine_keep_alive + 1.0)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        (await client.post("/v1/chat/completions", json=_body(-2, stream=False))).raise_for_status()
    await asyncio.sleep(0.5)
    return sockets_to(pid, port)


async def storm_figures(
    *, abandoned: int, clients: int, token_delay: float = 0.0, kind: str = "vllm", engine_keep_alive: int = 5
) -> Figures:
    """The whole check: reuse measured, storm run, then sockets, health and a normal answer checked.
    `engine_keep_alive`: the engine's idle-connection limit in seconds (5, uvicorn's default, as vLLM's
    server; shorter settles sooner)."""
    with gateway_over_fake_vllm(token_delay, kind, engine_keep_alive) as (server, state, port):
        pid = server.process.pid
        sequential = await connections_per_request(server, state, requests=100, concurrency=1)
        concurrent = await connections_per_request(server, state, requests=160, concurrency=16)
        before = await settled_sockets(server, pid, port, engine_keep_alive)
        storm = await abandon_storm(server, abandoned=abandoned, clients=clients)
        right_after = sockets_to(pid, port)
        after = await settled_sockets(server, pid, port, engine_keep_alive)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            answer = await client.post("/v1/chat/completions", json=_body(-1, stream=False))
            engines = (await client.get("/admin/engines")).json()["data"]
        return {
            **storm,
            "new_connections_per_request_sequential": round(sequential, 3),
            "new_connections_per_request_16_concurrent": round(concurrent, 3),
            "engine_sockets_before": before,
            "engine_sockets_right_after": right_after,
            "engine_sockets_after": after,
            "engine_requests": len(state.requests),
            "answers_after": answer.status_code,
            "engine_healthy_after": all(e["healthy"] for e in engines),
        }

"""The reliability suite: each check drives a real `tokentape serve` (loopback only, bounded in
count and time) or, where it needs a fast engine, an in-process gateway over the scripted engine,
and returns its figures. `tests/reliability/test_suite.py` runs a small version inside `make test`;
`make reliability` runs the full one and prints the table."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sqlite3
import statistics
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.support.served import build
from tokentape.core.tape import path_tokens
from tokentape.engines.scripted import ScriptedEngine
from tokentape.gateway.sessions import MemoryLimits
from tokentape.launcher import RunningServer, running_server
from tokentape.runtime import embedded_model_path, gguf_renderer
from tokentape.store.sqlite import SqliteStore

MODEL = "smollm2-135m-instruct"
Figures = dict[str, Any]


def _chat(content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6, **extra}


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- malformed requests ---------------------------------------------------------------------------------
def malformed_cases() -> list[tuple[str, str, str, bytes, dict[str, str]]]:
    """(kind, method, path, body, headers): at least forty different ways to be wrong."""
    j = {"content-type": "application/json"}
    deep = b"[" * 5000 + b"]" * 5000
    cases: list[tuple[str, str, str, bytes, dict[str, str]]] = [
        ("truncated JSON", "POST", "/v1/chat/completions", b'{"model": "x", "messages": [', j),
        ("empty body", "POST", "/v1/chat/completions", b"", j),
        ("whitespace body", "POST", "/v1/chat/completions", b"   \n ", j),
        ("invalid UTF-8", "POST", "/v1/chat/completions", b"\xff\xfe\x00{}", j),
        (
            "lone surrogate",
            "POST",
            "/v1/chat/completions",
            b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',
            j,
        ),
        ("NaN literal", "POST", "/v1/chat/completions", b'{"model":"m","temperature":NaN,"messages":[]}', j),
        ("trailing garbage", "POST", "/v1/chat/completions", b'{"model":"m"} xyz', j),
        ("byte order mark", "POST", "/v1/chat/completions", b'\xef\xbb\xbf{"model":"m"}', j),
        ("deeply nested", "POST", "/v1/chat/completions", deep, j),
        ("array body", "POST", "/v1/chat/completions", b"[1,2]", j),
        ("string body", "POST", "/v1/chat/completions", b'"hello"', j),
        ("null body", "POST", "/v1/chat/completions", b"null", j),
        ("number body", "POST", "/v1/chat/completions", b"1e400", j),
        (
            "form encoded",
            "POST",
            "/v1/chat/completions",
            b"model=x&messages=y",
            {"content-type": "application/x-www-form-urlencoded"},
        ),
        ("gzip claimed, not gzip", "POST", "/v1/chat/completions", b"{}", {**j, "content-encoding": "gzip"}),
        ("missing messages", "POST", "/v1/chat/completions", b'{"model":"m"}', j),
        ("messages not a list", "POST", "/v1/chat/completions", b'{"model":"m","messages":"hi"}', j),
        ("message not an object", "POST", "/v1/chat/completions", b'{"model":"m","messages":[5]}', j),
        ("role missing", "POST", "/v1/chat/completions", b'{"model":"m","messages":[{"content":"x"}]}', j),
        ("unknown role", "POST", "/v1/chat/completions", b'{"model":"m","messages":[{"role":"x","content":"x"}]}', j),
        (
            "content is an object",
            "POST",
            "/v1/chat/completions",
            b'{"model":"m","messages":[{"role":"user","content":{"a":1}}]}',
            j,
        ),
        (
            "model is a number",
            "POST",
            "/v1/chat/completions",
            b'{"model":5,"messages":[{"role":"user","content":"x"}]}',
            j,
        ),
        (
            "unknown model",
            "POST",
            "/v1/chat/completions",
            b'{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}',
            j,
        ),
        ("temperature string", "POST", "/v1/chat/completions", _bytes(_chat(temperature="hot")), j),
        ("temperature negative", "POST", "/v1/chat/completions", _bytes(_chat(temperature=-1)), j),
        ("top_p above one", "POST", "/v1/chat/completions", _bytes(_chat(top_p=1.5)), j),
        ("n zero", "POST", "/v1/chat/completions", _bytes(_chat(n=0)), j),
        ("n huge", "POST", "/v1/chat/completions", _bytes(_chat(n=10**6)), j),
        ("n boolean", "POST", "/v1/chat/completions", _bytes(_chat(n=True)), j),
        ("max_tokens float", "POST", "/v1/chat/completions", _bytes(_chat(max_tokens=2.5)), j),
        (
            "max_tokens 10^30",
            "POST",
            "/v1/chat/completions",
            b'{"model":"%s","messages":[{"role":"user",'
            b'"content":"x"}],"max_tokens":1000000000000000000000000000000}' % MODEL.encode(),
            j,
        ),
        ("seed 2^80", "POST", "/v1/chat/completions", _bytes(_chat(seed=2**80)), j),
        ("top_logprobs 100", "POST", "/v1/chat/completions", _bytes(_chat(logprobs=True, top_logprobs=100)), j),
        ("stop list of numbers", "POST", "/v1/chat/completions", _bytes(_chat(stop=[1, 2])), j),
        ("five stop strings", "POST", "/v1/chat/completions", _bytes(_chat(stop=list("abcde"))), j),
        ("stream string", "POST", "/v1/chat/completions", _bytes(_chat(stream="yes")), j),
        ("tools not a list", "POST", "/v1/chat/completions", _bytes(_chat(tools="calc")), j),
        (
            "too many messages",
            "POST",
            "/v1/chat/completions",
            _bytes({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 5000}),
            j,
        ),
        ("prompt beyond the context", "POST", "/v1/chat/completions", _bytes(_chat("word " * 6000)), j),
        ("bad session id", "POST", "/sessions/..%2F..%2Fetc/v1/chat/completions", _bytes(_chat()), j),
        (
            "conflicting session ids",
            "POST",
            "/v1/chat/completions",
            _bytes(_chat(session_id="b")),
            {**j, "x-session-id": "a"},
        ),
        (
            "completion token out of vocabulary",
            "POST",
            "/v1/completions",
            _bytes({"model": MODEL, "prompt": [10**9]}),
            j,
        ),
        (
            "completion prompt of mixed types",
            "POST",
            "/v1/completions",
            _bytes({"model": MODEL, "prompt": [1, "a"]}),
            j,
        ),
        ("tokenize without input", "POST", "/tokenize", b"{}", j),
        ("detokenize negative token", "POST", "/detokenize", _bytes({"tokens": [-1]}), j),
        ("reward not a number", "POST", "/sessions/none/reward", b'{"reward":"x"}', j),
        ("unknown export format", "GET", "/export?format=csv", b"", {}),
        ("unknown route", "GET", "/v1/nope", b"", {}),
        ("wrong method", "DELETE", "/v1/chat/completions", b"", {}),
        ("huge string value", "POST", "/v1/chat/completions", _bytes(_chat("x" * (17 * 1024 * 1024))), j),
        ("huge header", "GET", "/v1/models", b"", {"x-junk": "y" * 80_000}),
    ]
    return cases


def _bytes(value: Any) -> bytes:
    import json

    return json.dumps(value).encode()


async def malformed(server: RunningServer) -> Figures:
    cases = malformed_cases()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        before = (await http.get("/export")).json()
        outcomes = []
        for kind, method, path, body, headers in cases:
            response = await http.request(method, path, content=body or None, headers=headers)
            shaped = False
            if 400 <= response.status_code < 500:
                error = response.json().get("error", {})
                shaped = set(error) == {"message", "type", "param", "code"}
            outcomes.append((kind, response.status_code, shaped))
        healthy = (await http.get("/health")).status_code == 200
        unchanged = (await http.get("/export")).json() == before
    bad = [o for o in outcomes if not (400 <= o[1] < 500 and o[2])]
    return {
        "kinds": len(cases),
        "answered_4xx_openai": len(cases) - len(bad),
        "not_4xx": bad,
        "healthy": healthy,
        "sessions_unchanged": unchanged,
    }


# -- kill -9 loop ------------------------------------------------------------------------------------------
async def kill_loop(
    tmp: Path,
    *,
    cycles: int,
    sessions: int,
    seed: int = 0,
    engine_url: str | None = None,
    window: tuple[float, float] = (1.0, 3.0),
) -> Figures:
    """`sessions` multi-turn sessions run concurrently against a real `tokentape serve` that is
    killed with SIGKILL at a random moment of every cycle, then restarted on the same store; each
    session keeps extending its own history across cycles. Every acknowledged turn (answered 200)
    must be in the store afterwards exactly once. Every request carries its own random seed, so two
    attempts of one step sample differently and a turn stored twice is told from a repeated step.
    `engine_url`: a remote vLLM-format engine (else the embedded one)."""
    rng = random.Random(seed)
    store = tmp / "kill.sqlite3"
    args = ["--store", str(store), "--context-length", "4096"]
    if engine_url is not None:
        args += ["--engine", f"vllm={engine_url}", "--served-model-name", MODEL]
    acknowledged: dict[str, list[list[int]]] = {}  # session -> every acknowledged turn's prompt + tokens
    # each of `sessions` agents extends one session until its context is full, then starts the next
    current = {f"k{i}": f"k{i}" for i in range(sessions)}
    histories: dict[str, list[dict[str, Any]]] = {name: [] for name in current.values()}
    extended_after_restart = 0
    requests_cut = 0
    sessions_filled = 0

    answered = asyncio.Event()  # set by the first acknowledged turn of a cycle

    async def episode(base: str, agent: str) -> None:
        nonlocal requests_cut, sessions_filled
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            while True:
                session = current[agent]
                messages = [*histories[session], {"role": "user", "content": f"Step {len(histories[session])}"}]
                body = {"model": MODEL, "messages": messages, "max_tokens": 4, "seed": rng.randrange(1 << 30)}
                try:
                    response = await http.post(f"/sessions/{session}/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    requests_cut += 1  # killed mid-request: not acknowledged
                    return
                if response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded":
                    sessions_filled += 1
                    current[agent] = f"{agent}-{sessions_filled}"
                    histories[current[agent]] = []
                    continue
                if response.status_code != 200:
                    return
                data = response.json()
                answered.set()
                acknowledged.setdefault(session, []).append(data["prompt_token_ids"] + data["choices"][0]["token_ids"])
                histories[session] = [
                    *messages,
                    {"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                ]

    for _ in range(cycles):
        with running_server(args) as server:
            before = sum(len(v) for v in acknowledged.values())
            answered.clear()
            work = [asyncio.create_task(episode(server.base_url, agent)) for agent in current]
            # the kill comes at a random moment once traffic flows (a slow start is not a cycle without turns)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(answered.wait(), timeout=60)
            await asyncio.sleep(rng.uniform(*window))
            os.kill(server.process.pid, signal.SIGKILL)  # at a random moment, mid-generation
            await asyncio.gather(*work, return_exceptions=True)
            server.process.wait()
            extended_after_restart += int(sum(len(v) for v in acknowledged.values()) > before)
    # after the last kill, the store as a restarting gateway loads it (its own reader, in this process:
    # the restarts of the cycles above already showed a gateway starting on it)
    lost = rewrites = 0
    reader = SqliteStore(store)
    try:
        for session, turns in acknowledged.items():
            tree = await reader.load(session)
            paths = [path_tokens(node) for node in tree.nodes] if tree is not None else []
            for sequence in turns:
                if not any(p[: len(sequence)] == sequence for p in paths):
                    lost += 1
            rewrites += len(tree.rewrites) if tree is not None else 0
    finally:
        reader.close()
    stored = _stored_paths(store)
    duplicates = sum(
        max(0, stored.get(session, []).count(tuple(t)) - 1) for session, ts in acknowledged.items() for t in ts
    )
    return {
        "cycles": cycles,
        "sessions": sessions,
        "acknowledged_turns": sum(len(v) for v in acknowledged.values()),
        "acknowledged_turns_lost": lost,
        "duplicate_turns": duplicates,
        "stored_turns": sum(len(v) for v in stored.values()),
        "requests_cut_by_kill": requests_cut,
        "longest_history_tokens": max((len(ts[-1]) for ts in acknowledged.values()), default=0),
        "cycles_that_extended_sessions": extended_after_restart,
        "sessions_filled_to_their_context": sessions_filled,
        "rewrites_after_restarts": rewrites,
    }


def _stored_paths(path: Path) -> dict[str, list[tuple[int, ...]]]:
    """Every stored turn's whole token path (root to its last sampled token), per session, read
    from the SQLite file with plain SQL: the check does not go through the store's own reader."""
    db = sqlite3.connect(path)
    paths: dict[str, list[tuple[int, ...]]] = {}
    nodes: dict[tuple[str, int], tuple[int, ...]] = {}
    query = "SELECT session_id, id, parent, keep, context, sampled FROM turns ORDER BY session_id, id"
    for session, ident, parent, keep, context, sampled in db.execute(query):
        head = nodes[(session, parent)][:keep] if parent is not None else ()
        path = head + tuple(array("q", context)) + tuple(array("q", sampled))
        nodes[(session, ident)] = path
        paths.setdefault(session, []).append(path)
    db.close()
    return paths


# -- disconnect storm ----------------------------------------------------------------------------------------
async def disconnect_storm(server: RunningServer, *, clients: int, seed: int = 0) -> Figures:
    """Clients that leave mid-stream, one at a time. Every generation must end as `abort`: one that
    ran to `length` or `stop` despite the client leaving counts as a failure. At the engine: every
    token it generated is on the tape, and how far it ran past what the client had received."""
    rng = random.Random(seed)
    aborted = 0
    overruns: list[int] = []
    unrecorded = 0
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        for i in range(clients):
            body = {**_chat("Write a long story about the sea."), "max_tokens": 300, "stream": True, "seed": i}
            before = (await http.get("/health")).json()["tokens_generated"]
            stop_after = rng.randint(1, 12)
            received = 0
            async with http.stream("POST", f"/sessions/storm-{i}/v1/chat/completions", json=body) as response:
                seen = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        received += sum(len(c.get("token_ids", [])) for c in orjson.loads(line[6:])["choices"])
                    if seen >= stop_after:
                        break
            generated = await _settled_tokens(http) - before
            (branch,) = (await http.get(f"/sessions/storm-{i}/export")).json()["branches"]
            aborted += branch["finish_reasons"] == ["abort"]
            unrecorded += generated - sum(branch["loss_mask"])
            overruns.append(generated - received)
    return {
        "clients": clients,
        "generations_aborted": aborted,
        "aborted_ratio": aborted / max(1, clients),
        "tokens_generated_not_on_the_tape": unrecorded,
        "max_tokens_generated_after_the_last_received": max(overruns, default=0),
    }


async def _settled_tokens(http: httpx.AsyncClient) -> int:
    """The engine's token count once it stops changing (generation has ended)."""
    last = (await http.get("/health")).json()["tokens_generated"]
    for _ in range(100):
        await asyncio.sleep(0.1)
        now = (await http.get("/health")).json()["tokens_generated"]
        if now == last:
            return int(now)
        last = now
    raise AssertionError("generation did not stop")


# -- overload ---------------------------------------------------------------------------------------------
async def overload(server: RunningServer, *, offered: int, waves: int) -> Figures:
    latencies: list[float] = []
    rejected = 0
    peak = 0
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:

        async def one(i: int) -> None:
            nonlocal rejected, peak
            start = time.monotonic()
            response = await http.post(f"/sessions/load-{i}/v1/chat/completions", json=_chat(max_tokens=8))
            peak = max(peak, _rss_kb(server.process.pid))
            if response.status_code == 429:
                assert "retry-after" in response.headers and response.json()["error"]["type"] == "rate_limit_error"
                rejected += 1
            else:
                assert response.status_code == 200, response.text
                latencies.append(time.monotonic() - start)

        for wave in range(waves):
            await asyncio.gather(*(one(wave * offered + i) for i in range(offered)))
    total = offered * waves
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else (latencies or [0.0])[0]
    return {
        "offered_concurrency": offered,
        "requests": total,
        "rejected_429_pct": 100.0 * rejected / total,
        "admitted_p99_s": round(p99, 3),
        "peak_rss_mb": round(peak / 1024, 1),
    }


# -- retry storm ------------------------------------------------------------------------------------------
async def retry_storm(server: RunningServer, *, requests: int, retries: int) -> Figures:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
        calls_before = (await http.get("/health")).json()["engine_calls"]

        async def one(i: int) -> None:
            body = _chat(f"Question {i}", max_tokens=8)
            url = f"/sessions/retry-{i}/v1/chat/completions"
            first = asyncio.create_task(http.post(url, json=body))
            # as an SDK does, retry only once the first attempt is in the gateway (its session exists):
            # a fixed pause let retries overtake their original when many were sent at once
            while not first.done() and (await http.get(f"/sessions/retry-{i}")).status_code == 404:
                await asyncio.sleep(0.005)
            again = [http.post(url, json=body, headers={"x-stainless-retry-count": str(k + 1)}) for k in range(retries)]
            answers = await asyncio.gather(first, *again)
            ids = {tuple(a.json()["choices"][0]["token_ids"]) for a in answers}
            assert len(ids) == 1

        await asyncio.gather(*(one(i) for i in range(requests)))
        turns = 0
        for i in range(requests):
            turns += (await http.get(f"/sessions/retry-{i}")).json()["turns"]
        calls = (await http.get("/health")).json()["engine_calls"] - calls_before
    return {
        "requests": requests,
        "retries_each": retries,
        "duplicate_turns": turns - requests,
        "engine_calls_per_turn": calls / max(1, turns),
    }


# -- soak ---------------------------------------------------------------------------------------------------
async def soak(
    tmp: Path, *, sessions: int, batch: int = 250, progress: Callable[[int], None] = lambda _: None
) -> Figures:
    """Many short sessions through an in-process gateway (scripted engine); memory and open files are
    sampled per batch. Sessions are finished and may be evicted from memory: the store keeps them."""
    renderer = gguf_renderer(embedded_model_path())
    engine = ScriptedEngine(renderer.tokenizer.encode("Fine, thanks."), renderer.tokenizer.encode("<|im_end|>")[0])
    store = SqliteStore(tmp / "soak.sqlite3")
    built = build(engine, renderer, model=MODEL, store=store, memory=MemoryLimits(max_sessions=500))
    app, registry = built.app, built.gateway.sessions
    samples: list[tuple[int, int, int]] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        for start in range(0, sessions, batch):
            for i in range(start, min(sessions, start + batch)):
                messages: list[dict[str, Any]] = [{"role": "user", "content": f"Hello {i}"}]
                reply = (
                    await http.post(
                        f"/sessions/soak-{i}/v1/chat/completions", json={"model": MODEL, "messages": messages}
                    )
                ).json()
                messages += [
                    {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And you?"},
                ]
                await http.post(f"/sessions/soak-{i}/v1/chat/completions", json={"model": MODEL, "messages": messages})
                await http.post(f"/sessions/soak-{i}/finish")
            samples.append((min(sessions, start + batch), _rss_kb(os.getpid()), len(os.listdir("/proc/self/fd"))))
            progress(samples[-1][0])
    registry.store.close()
    (n0, rss0, fd0), (n1, rss1, fd1) = samples[0], samples[-1]
    per_thousand = (rss1 - rss0) / 1024 / max(1, (n1 - n0) / 1000)
    return {
        "sessions": sessions,
        "rss_growth_mb_per_1000_sessions": round(per_thousand, 2),
        "open_files_growth": fd1 - fd0,
        "sessions_in_memory_at_end": len(registry),
    }


# -- odd session ids ----------------------------------------------------------------------------------------
ODD_PATH_IDS = [
    "a/b", "a%2Fb", "a%2fb", "%2e%2e", "%2E%2E/x", "abc%0A", "abc%0D%0A", "x%00y", "a%20b", "%E2%80%AE",
    "caf%C3%A9", "-x", "x" * 129, "%", "%zz", "a;b", "%3Cscript%3E", "..%2F..%2Fetc", "a%09b", "%0A",
]  # fmt: skip
ODD_VALUES = ["abc\n", "..", "../etc", "a/b", "a b", "-x", "x" * 129, "\u00e9", "a\u0000b", "<x>", "a\tb", " x"]
GOOD_IDS = ["ok", "a" * 128, "ok-1.2:3_x", "Z9"]


async def _raw_status(base_url: str, request: bytes) -> int:
    """Send bytes as they are (no client normalising `..` away) and read the status code."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        status_line = await reader.readline()
        return int(status_line.split()[1])
    finally:
        writer.close()


async def odd_session_ids(server: RunningServer, *, requests: int, seed: int = 0) -> Figures:
    """Session ids with slashes, percent-encoding, `..`, control characters and unicode, through every
    way a session is named (base URL, header, body field, POST /sessions, session routes, raw HTTP),
    mixed with well-formed ones. No answer may be a 5xx; a bad id in a generation route is a 400
    `invalid_session_id`; the engine stays healthy."""
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    bad_not_rejected: list[tuple[str, str, int]] = []
    chat = {**_chat(max_tokens=1)}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        for i in range(requests):
            way = rng.choice(["path", "path-completion", "header", "body", "create", "route", "raw"])
            good = rng.random() < 0.05
            if way.startswith("path"):
                name = rng.choice(GOOD_IDS) if good else rng.choice(ODD_PATH_IDS)
                route = "completions" if way == "path-completion" else "chat/completions"
                body: dict[str, Any] = (
                    {"model": MODEL, "prompt": "Hi", "max_tokens": 1} if "completion" in way else chat
                )
                response = await http.post(f"/sessions/{name}/v1/{route}", json=body)
            elif way == "header":
                name = (
                    rng.choice(GOOD_IDS)
                    if good
                    else rng.choice([v for v in ODD_VALUES if v.isascii() and v.isprintable() and v == v.strip()])
                )
                response = await http.post("/v1/chat/completions", json=chat, headers={"x-session-id": name})
            elif way == "body":
                name = rng.choice(GOOD_IDS) if good else rng.choice(ODD_VALUES)
                response = await http.post(f"/sessions/s{i % 7}/v1/chat/completions", json={**chat, "session_id": name})
            elif way == "create":
                name = f"new-{i}" if good else rng.choice(ODD_VALUES)
                response = await http.post("/sessions", json={"session_id": name})
            elif way == "route":
                name = rng.choice(GOOD_IDS) if good else rng.choice(ODD_PATH_IDS)
                method, suffix = rng.choice([("GET", ""), ("GET", "/export"), ("POST", "/finish"), ("DELETE", "")])
                response = await http.request(method, f"/sessions/{name}{suffix}")
            else:
                name = rng.choice(["..", "a/../b", "../..", "./x", "a/./b"])
                payload = orjson.dumps(chat)
                head = (
                    f"POST /sessions/{name}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                )
                status = await _raw_status(server.base_url, head.encode() + payload)
                statuses[status] = statuses.get(status, 0) + 1
                if status != 400:
                    bad_not_rejected.append((way, name, status))
                continue
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if not good and way in ("path", "path-completion", "header", "body", "create"):
                code = response.json().get("error", {}).get("code") if response.status_code == 400 else None
                if code != "invalid_session_id":
                    bad_not_rejected.append((way, name, response.status_code))
        healthy = (await http.get("/health")).status_code == 200
        still_serving = (await http.post("/sessions/after-odd/v1/chat/completions", json=chat)).status_code == 200
    return {
        "requests": requests,
        "statuses": dict(sorted(statuses.items())),
        "responses_5xx": sum(n for status, n in statuses.items() if status >= 500),
        "bad_ids_not_rejected_400": bad_not_rejected[:10],
        "healthy": healthy and still_serving,
    }

"""Malformed engine answers: a table of mutations of the events a vLLM- or SGLang-format engine streams
(every field of a real event dropped or replaced by a value of another type, plus whole lines that are
not JSON, error events, out-of-range IDs and NaN logprobs), served by the stand-in engines of
tests/support/fake_engines.py at the first or the last event of a generation.

`adapter_run` feeds each to the adapter directly: the only acceptable outcomes are the tokens or one of
the engine errors of tokentape's error tree, with a message. `gateway_run` sends requests through a
real `tokentape serve`: no answer >= 500 other than 502/503 with a message, and the session unchanged
whenever the request failed."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.fake_engines import FakeState, serving, sglang_app, vllm_app
from tokentape.core.sampling import SamplingParams
from tokentape.engines.remote import ENGINE_KINDS, RemoteEngine
from tokentape.errors import TokentapeError
from tokentape.launcher import RunningServer, running_server

Path = tuple[str | int, ...]
Figures = dict[str, Any]

REPLACEMENTS: list[tuple[str, Any]] = [
    ("null", None),
    ("a string", "x"),
    ("-1", -1),
    ("1.5", 1.5),
    ("an empty list", []),
    ("an empty object", {}),
    ("true", True),
    ("a huge int", 10**12),
    ("token_id:x", "token_id:x"),
    ("a nested list", [[1, 2], [3]]),
    ("an object", {"a": 1}),
    ("a positive logprob", 3.0),
    ("a long list", list(range(50))),
]
RAW_LINES: list[tuple[str, bytes]] = [
    ("truncated JSON", b'{"choices": [{"index": 0, "token_ids": [5'),
    ("not JSON", b"hello engine"),
    ("empty data", b""),
    ("JSON list", b"[1, 2, 3]"),
    ("JSON string", b'"just text"'),
    ("JSON null", b"null"),
    ("invalid UTF-8", b"\xff\xfe\xfd"),
    ("NaN literal", b'{"choices": NaN}'),
    ("error event 500", b'{"error": {"message": "engine exploded", "code": 500}}'),
    ("error event 400", b'{"error": {"message": "bad sampling parameters", "code": 400}}'),
    ("error as text", b'{"error": "flat error text"}'),
    ("deep nesting", b"[" * 3000 + b"]" * 3000),
    ("DONE misspelt", b"[DONE"),
]


@dataclass(frozen=True)
class Mutation:
    name: str
    at: str  # "first" or "last" event
    rewrite: Callable[[dict[str, Any]], bytes]


def _paths(value: Any, prefix: Path = ()) -> Iterator[Path]:
    if isinstance(value, dict):
        for key, child in value.items():
            yield (*prefix, key)
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value[:2]):
            yield (*prefix, index)
            yield from _paths(child, (*prefix, index))


def _replaced(event: Any, path: Path, value: Any, delete: bool = False) -> bytes:
    event = json.loads(json.dumps(event))
    node = event
    for step in path[:-1]:
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            return json.dumps(event).encode()  # this event lacks the path: sent unchanged
    last = path[-1]
    with contextlib.suppress(KeyError, IndexError, TypeError):
        if delete:
            del node[last]
        else:
            node[last] = value
    return json.dumps(event).encode()


def mutations(sample: dict[str, Any]) -> list[Mutation]:
    """Every path of `sample` dropped or replaced, plus the raw lines, at the first and the last event."""
    table: list[Mutation] = []
    for at in ("first", "last"):
        for path in _paths(sample):
            label = ".".join(str(p) for p in path)
            table.append(Mutation(f"{label} dropped", at, lambda e, p=path: _replaced(e, p, None, delete=True)))
            for name, value in REPLACEMENTS:
                table.append(Mutation(f"{label} = {name}", at, lambda e, p=path, v=value: _replaced(e, p, v)))
        for name, raw in RAW_LINES:
            table.append(Mutation(name, at, lambda _, r=raw: r))
    return table


def _apps(kind: str) -> Callable[[FakeState], Any]:
    return sglang_app if kind == "sglang" else vllm_app


def _install(state: FakeState, mutation: Mutation | None, length: int) -> None:
    if mutation is None:
        state.mangle = None
        return
    target = 0 if mutation.at == "first" else length - 1

    def mangle(index: int, event: dict[str, Any]) -> bytes:
        return mutation.rewrite(event) if index == target else json.dumps(event).encode()

    state.mangle = mangle


async def _sample_event(engine: RemoteEngine, state: FakeState, params: SamplingParams) -> tuple[dict[str, Any], int]:
    seen: list[dict[str, Any]] = []

    def record(_: int, event: dict[str, Any]) -> bytes:
        seen.append(event)
        return json.dumps(event).encode()

    state.mangle = record
    async for _ in engine.generate([1, 2, 3], params, seed=1):
        pass
    state.mangle = None
    return seen[0], len(seen)


async def adapter_run(kind: str, *, limit: int | None = None, seed: int = 0) -> Figures:
    """Every mutation against the adapter of `kind`; counts outcomes, lists any unexpected exception."""
    state = FakeState()
    params = SamplingParams(max_tokens=5, logprobs=True, top_logprobs=2)
    with serving(_apps(kind)(state)) as url:
        engine = ENGINE_KINDS[kind](url)
        engine.vocab_size = 49152
        sample, length = await _sample_event(engine, state, params)
        table = mutations(sample)
        if limit is not None:
            table = random.Random(seed).sample(table, min(limit, len(table)))
        outcomes = {"tokens": 0, "engine_error": 0, "request_error": 0}
        unexpected: list[str] = []
        for mutation in table:
            _install(state, mutation, length)
            try:
                async for _ in engine.generate([1, 2, 3], params, seed=1):
                    pass
                outcomes["tokens"] += 1
            except TokentapeError as exc:
                if not exc.message:
                    unexpected.append(f"{mutation.at} {mutation.name}: an error without a message")
                outcomes["engine_error" if exc.status >= 500 else "request_error"] += 1
            except Exception as exc:  # what the adapters must never let out
                unexpected.append(f"{mutation.at} {mutation.name}: {exc!r}")
        await engine.close()
    return {"kind": kind, "mutations": len(table), **outcomes, "unexpected": unexpected}


async def _route_to(server: RunningServer, spec: str, url: str) -> None:
    """Add the engine `spec` to the running gateway's pool and drain every other: new sessions go to it."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        others = [e["url"] for e in (await http.get("/admin/engines")).json()["data"] if e["url"] != url]
        (await http.post("/admin/engines", json={"add": spec})).raise_for_status()
        for other in others:
            (await http.post("/admin/engines", json={"drain": other})).raise_for_status()


async def gateway_run(
    kind: str, *, limit: int | None = None, seed: int = 0, gateway: RunningServer | None = None
) -> Figures:
    """Mutations served to a real `tokentape serve`: every answer < 500 or 502/503 with a message, and the
    session's export unchanged by every request that failed. `gateway`: a running one (any remote
    engine) whose pool is turned over to this run's engine, instead of a new one."""
    state = FakeState()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(serving(_apps(kind)(state)))
        if gateway is None:
            server = stack.enter_context(running_server(["--engine", f"{kind}={url}"]))
        else:
            server = gateway
            await _route_to(server, f"{kind}={url}", url)
        engine = ENGINE_KINDS[kind](url)
        sample, length = await _sample_event(engine, state, SamplingParams(max_tokens=5, logprobs=True, top_logprobs=2))
        await engine.close()
        table = mutations(sample)
        if limit is not None:
            table = random.Random(seed).sample(table, min(limit, len(table)))
        statuses: dict[int, int] = {}
        bad: list[str] = []
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for i, mutation in enumerate(table):
                # a session with one good turn, then the mutated answer to its second request
                session = f"/sessions/fuzz-{kind}-{i}"
                messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello"}]
                first = await http.post(f"{session}/v1/chat/completions", json=_chat(messages))
                first.raise_for_status()
                messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "And then?"}]
                before = (await http.get(f"{session}/export")).json()
                _install(state, mutation, length)
                response = await http.post(f"{session}/v1/chat/completions", json=_chat(messages))
                _install(state, None, length)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                label = f"{mutation.at} {mutation.name}"
                if response.status_code >= 500 and response.status_code not in (502, 503):
                    bad.append(f"{label}: {response.status_code} {response.text[:200]}")
                if response.status_code >= 400:
                    if not response.json().get("error", {}).get("message"):
                        bad.append(f"{label}: {response.status_code} without a message")
                    after = (await http.get(f"{session}/export")).json()
                    if after["branches"] != before["branches"]:
                        bad.append(f"{label}: the failed request changed the session")
            health = (await http.get("/admin/engines")).json()["data"]
    return {
        "kind": kind,
        "mutations": len(table),
        "statuses": statuses,
        "bad": bad,
        "engine_generations": len(state.requests),  # every request of the run reached this run's engine
        # this run's engine, healthy (an engine of an earlier run may still be leaving the pool)
        "engine_healthy_after": any(e["url"] == url for e in health)
        and all(e["healthy"] for e in health if e["url"] == url),
    }


def _chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "fake-model", "messages": messages, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}

"""`GET /metrics` after a scripted run on the real engine: every count equals what the exports and
session summaries say (turns by finish reason, prompt and sampled tokens, rewrites by kind, sessions
finished and live), one engine and store timing per turn, and the 429s the client saw."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL_NAME
from tokentape.gateway.service import Gateway


async def _chat(http: httpx.AsyncClient, session: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 10, "temperature": 0.7, "seed": 1, **extra}
    return await http.post(f"/sessions/{session}/v1/chat/completions", json=body)


async def _scripted_run(http: httpx.AsyncClient, gateway: Gateway) -> int:
    """Several kinds of turn, a rewrite, a finished session, and a burst past the admission limit.
    Returns how many requests were answered 429."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    first = (await _chat(http, "plain", messages)).json()
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "More?"},
    ]
    async with http.stream(
        "POST",
        "/sessions/plain/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 3, "stream": True},
    ) as streamed:
        async for _ in streamed.aiter_lines():
            pass
    assert (await http.post("/sessions/plain/finish")).status_code == 200

    assert (await _chat(http, "two", [{"role": "user", "content": "Name a fruit."}], n=2)).status_code == 200
    edited = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Something the model never said."},
        {"role": "user", "content": "Why?"},
    ]
    assert (await _chat(http, "two", edited)).status_code == 200  # an edited reply: a rewrite
    raw = {"model": MODEL_NAME, "prompt": "1, 2, 3,", "max_tokens": 8, "stop": [","], "temperature": 0}
    assert (await http.post("/sessions/raw/v1/completions", json=raw)).status_code == 200

    gateway.admission.max_active = 1  # one request at a time: a burst of four gets 429s
    try:
        burst = await asyncio.gather(
            *(_chat(http, f"burst-{i}", [{"role": "user", "content": "Go"}]) for i in range(4))
        )
    finally:
        gateway.admission.max_active = 64
    statuses = [r.status_code for r in burst]
    assert set(statuses) == {200, 429}
    return statuses.count(429)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus samples by name and labels, read with prometheus-client's own parser."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_count_what_the_exports_hold(http: httpx.AsyncClient, gateway: Gateway) -> None:
    rejected = await _scripted_run(http, gateway)
    response = await http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = _samples(response.text)

    def value(name: str, **labels: str) -> float:
        """A sample the server exported; a missing one fails (it is not read as 0)."""
        key = (name, tuple(sorted(labels.items())))
        assert key in samples, f"/metrics has no sample {name}{labels or ''}"
        return samples[key]

    # what the session routes say, computed independently of the counters
    ids = [s["session_id"] for s in (await http.get("/sessions")).json()["data"]]
    finishes: Counter[str] = Counter()
    rewrites: Counter[str] = Counter()
    prompt_tokens = sampled_tokens = finished = 0
    for session in ids:
        export = (await http.get(f"/sessions/{session}/export")).json()
        turns: dict[int, tuple[str, int]] = {}  # turn id -> (finish reason, prompt length)
        for branch in export["branches"]:
            assert len(branch["turn_ids"]) == len(branch["action_ranges"]) == len(branch["finish_reasons"])
            for turn, (start, _), reason in zip(
                branch["turn_ids"], branch["action_ranges"], branch["finish_reasons"], strict=True
            ):
                turns[turn] = (reason, start)
        finishes.update(reason for reason, _ in turns.values())
        prompt_tokens += sum(start for _, start in turns.values())
        sampled_tokens += export["summary"]["sampled_tokens"]
        finished += export["summary"]["finished"]
        summary = (await http.get(f"/sessions/{session}")).json()
        rewrites.update(event["kind"] for event in summary["rewrite_events"])
    total_turns = sum(finishes.values())
    # the run exercised what it was meant to
    assert {"stop", "length"} <= set(finishes) and rewrites["assistant_edited"] == 1 and finished == 1

    for reason, count in finishes.items():
        assert value("tokentape_turns_total", finish_reason=reason) == count
    assert value("tokentape_prompt_tokens_total") == prompt_tokens
    assert value("tokentape_sampled_tokens_total") == sampled_tokens
    for kind, count in rewrites.items():
        assert value("tokentape_rewrites_total", kind=kind) == count
    assert value("tokentape_sessions_finished_total") == finished
    assert value("tokentape_sessions_live") == len(ids) - finished
    assert value("tokentape_overloaded_rejections_total") == rejected
    assert value("tokentape_requests_active") == 0
    assert value("tokentape_engine_seconds_count") == total_turns
    # only a client that streams waits for a first token: the run has one such request
    assert value("tokentape_time_to_first_token_seconds_count") == 1
    assert value("tokentape_store_write_seconds_count") == total_turns
    assert 0 < value("tokentape_time_to_first_token_seconds_sum") <= value("tokentape_engine_seconds_sum")
    # memory (scraped again: reading the exports loaded sessions): what the gateway holds against its
    # budget, and the process's resident set as the kernel counts it
    samples = _samples((await http.get("/metrics")).text)
    # one sample a kind, as the gateway's one account counts it; their sum is what the budget is held to
    kinds = gateway.sessions.held.by_kind()
    assert {"tapes", "template_inputs", "images", "retry_records", "parses", "responses"} <= set(kinds)
    for kind, held in kinds.items():
        assert value("tokentape_memory_held_bytes", kind=kind) == held
    assert sum(kinds.values()) == gateway.sessions.held_bytes > 0 and kinds["tapes"] > 0
    assert value("tokentape_memory_budget_bytes") == gateway.sessions.limits.max_bytes
    assert value("tokentape_image_cache_bytes") == gateway.sessions.images.held_bytes
    assert value("tokentape_engine_image_resends") == 0
    (line,) = [line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:")]
    resident = int(line.split()[1]) * 1024
    assert abs(value("process_resident_memory_bytes") - resident) < resident * 0.2

"""Two gateway actors on a single-machine Ray, the embedded model in each, driven by the real openai
SDK: sessions spread over the gateways, a request reaches its session's owner whichever gateway it
hits (base URL, header, body field; streamed too), exports gather every shard and equal what every
call returned, a gateway killed with SIGKILL loses no acknowledged turn, and the trajectory queue
hands over every finished session once."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import ray

from tests.ray.conftest import free_port_block
from tests.support.http_client import fresh_connections

HTTP = fresh_connections()  # one TLS context for the module's calls, a connection for each

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Name a colour."}]


class Front:
    """The front HTTP API (owns no session) served from this process in a thread."""

    def __init__(self, port: int) -> None:
        import uvicorn

        from tokentape.ray import front_app

        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(front_app(), host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def cluster(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tokentape.ray import RayOptions, ServeSpec, start_cluster

    first = free_port_block(3)
    started = start_cluster(
        ServeSpec(
            context_length=2048,
            threads=1,
            port=first,  # gateway i serves on first + 1 + i
            ray=RayOptions(
                gateways=2,
                store_dir=str(tmp_path_factory.mktemp("shards")),
                trajectory_queue="test",
                queue_capacity=64,
                engine_actors=2,
            ),
        )
    )
    front = Front(first)
    try:
        yield {"cluster": started, "front": front.url, "gateways": started.gateway_urls}
    finally:
        front.stop()
        started.stop()


def _sdk(base_url: str, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, default_headers=headers or None)


async def _turns(client: openai.AsyncOpenAI, turns: int, **extra: Any) -> list[list[int]]:
    """Run a conversation; each call's prompt + completion tokens, as the responses said."""
    messages: list[dict[str, Any]] = list(QUESTION)
    seen = []
    for _ in range(turns):
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            **extra,  # type: ignore[arg-type]
        )
        raw = reply.model_dump()
        seen.append(raw["prompt_token_ids"] + raw["choices"][0]["token_ids"])
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "And another?"},
        ]
    return seen


def _check_exact(exported: dict[str, Any], calls: list[list[int]]) -> None:
    """Every call's tokens are a prefix of the session's one branch, and the last call ends it
    (the branch is the last prompt plus the last completion)."""
    (branch,) = exported["branches"]
    for tokens in calls:
        assert branch["tokens"][: len(tokens)] == tokens
    assert branch["tokens"] == calls[-1]
    assert len(branch["turn_ids"]) == len(calls)


def test_sessions_spread_and_every_export_is_exact(cluster: dict[str, Any]) -> None:
    front, gateways = cluster["front"], cluster["gateways"]
    created = [HTTP.post(f"{front}/sessions", json={"session_id": f"spread-{i}"}).json() for i in range(4)]
    owners = {c["base_url"].split("/sessions/")[0] for c in created}
    assert owners == set(gateways.values()), "new sessions go to the least-loaded gateway: both get some"

    async def run() -> list[list[list[int]]]:
        return await asyncio.gather(*(_turns(_sdk(c["base_url"]), 2) for c in created))

    calls = asyncio.run(run())
    for c, seen in zip(created, calls, strict=True):
        owner = c["base_url"].split("/sessions/")[0]
        exported = HTTP.get(f"{owner}/sessions/{c['session_id']}/export").json()
        _check_exact(exported, seen)
    # the engines are shared: sessions of both gateways spread over both engine actors, and stay
    engines = ray.get(cluster["cluster"].registry.describe.remote())
    assert sorted(engines["sessions"].values()) == [2, 2] and engines["moves"] == 0
    assert sum(engines["in_flight"].values()) == 0
    # any gateway (and the front) gathers every shard
    for url in [front, *gateways.values()]:
        listed = {row["session_id"] for row in HTTP.get(f"{url}/export", params={"prefix": "spread-"}).json()["data"]}
        assert listed == {c["session_id"] for c in created}


def test_a_request_naming_its_session_by_header_or_body_reaches_the_owner(cluster: dict[str, Any]) -> None:
    front, gateways = cluster["front"], cluster["gateways"]
    created = HTTP.post(f"{front}/sessions", json={"session_id": "named-elsewhere"}).json()
    owner = created["base_url"].split("/sessions/")[0]
    (other,) = [url for url in gateways.values() if url != owner]

    async def run() -> list[list[int]]:
        by_header = await _turns(_sdk(f"{other}/v1", **{"X-Session-ID": "named-elsewhere"}), 1)
        client = _sdk(f"{other}/v1")
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"session_id": "named-elsewhere"},
        )
        streamed_tokens: list[int] = []
        prompt: list[int] = []
        async for chunk in stream:
            raw = chunk.model_dump()
            prompt = raw.get("prompt_token_ids") or prompt  # on the first chunk
            for choice in raw["choices"]:
                streamed_tokens += choice.get("token_ids") or []
        return [*by_header, prompt + streamed_tokens]

    by_header, streamed = asyncio.run(run())
    exported = HTTP.get(f"{owner}/sessions/named-elsewhere/export").json()
    # same first message twice: two sibling branches, one per call, each exactly what that call saw
    branches = sorted(branch["tokens"] for branch in exported["branches"])
    assert branches == sorted([by_header, streamed])
    assert exported["summary"]["turns"] == 2
    # the non-owner's shard holds nothing of it
    assert HTTP.get(f"{other}/export", params={"prefix": "named-elsewhere"}).json()["data"]


def test_metrics_on_the_gateways_count_what_the_shards_hold(cluster: dict[str, Any]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    counted = {"tokentape_turns_total": 0.0, "tokentape_sampled_tokens_total": 0.0}
    for url in cluster["gateways"].values():
        for family in text_string_to_metric_families(HTTP.get(f"{url}/metrics").text):
            for sample in family.samples:
                if sample.name in counted:
                    counted[sample.name] += sample.value
    listed = HTTP.get(f"{cluster['front']}/sessions").json()["data"]
    assert counted["tokentape_turns_total"] == sum(s["turns"] for s in listed) > 0
    assert counted["tokentape_sampled_tokens_total"] == sum(s["sampled_tokens"] for s in listed) > 0


def test_every_gateway_bounds_a_request_head_before_its_app(cluster: dict[str, Any]) -> None:
    """The gateway actors serve with `tokentape serve`'s bounded protocol: more headers than it takes
    (256, each small enough for the app's own byte limit) get 431 before the app reads them."""
    many = [(f"x-h{i}", "v") for i in range(300)]
    for url in cluster["gateways"].values():
        response = HTTP.get(f"{url}/health", headers=many)
        assert response.status_code == 431, response.text
        assert HTTP.get(f"{url}/health").status_code == 200


def test_the_front_pages_through_every_shard_in_order(cluster: dict[str, Any]) -> None:
    front = cluster["front"]
    everything = HTTP.get(f"{front}/sessions").json()["data"]
    paged: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = HTTP.get(f"{front}/sessions", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        assert len(page["data"]) <= 2
        paged += page["data"]
        if not page["has_more"]:
            break
        cursor = page["next_cursor"]
    ids = [s["session_id"] for s in paged]
    assert ids == [s["session_id"] for s in everything] and len(set(ids)) == len(ids) >= 5
    assert [s["created_at"] for s in paged] == sorted(s["created_at"] for s in paged)


def test_a_client_leaving_a_stream_at_another_gateway_stops_the_owners_generation(cluster: dict[str, Any]) -> None:
    front, gateways = cluster["front"], cluster["gateways"]
    created = HTTP.post(f"{front}/sessions", json={"session_id": "left-early"}).json()
    owner = created["base_url"].split("/sessions/")[0]
    (other,) = [url for url in gateways.values() if url != owner]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from 1 to 500, separated by commas."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with HTTP.stream(
        "POST", f"{other}/v1/chat/completions", json=body, headers={"X-Session-ID": "left-early"}, timeout=60
    ) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few events, then the client hangs up
    assert any(line.startswith("data: {") for line in received)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (branch,) = HTTP.get(f"{owner}/sessions/left-early/export").json()["branches"] or [None]
        if branch is not None:
            break
        time.sleep(0.5)
    assert branch is not None, "the aborted turn was recorded"
    assert branch["finish_reasons"] == ["abort"]
    assert sum(branch["loss_mask"]) < 400


def test_a_killed_gateway_loses_no_acknowledged_turn_and_its_sessions_go_on(cluster: dict[str, Any]) -> None:
    started, front = cluster["cluster"], cluster["front"]
    created = [HTTP.post(f"{front}/sessions", json={"session_id": f"survivor-{i}"}).json() for i in range(4)]
    acknowledged: dict[str, list[list[int]]] = {c["session_id"]: [] for c in created}
    victim = started.describe()[0]

    async def agent(c: dict[str, Any], stop: asyncio.Event) -> None:
        client = _sdk(c["base_url"])
        messages: list[dict[str, Any]] = list(QUESTION)
        while not stop.is_set():
            try:
                reply = await client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=4,
                    temperature=0,  # type: ignore[arg-type]
                )
            except (openai.APIConnectionError, openai.APIStatusError):
                await asyncio.sleep(0.2)  # the owner is restarting; the agent tries its turn again
                continue
            raw = reply.model_dump()
            acknowledged[c["session_id"]].append(raw["prompt_token_ids"] + raw["choices"][0]["token_ids"])
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "More."},
            ]

    on_victim = [c["session_id"] for c in created if c["base_url"].startswith(victim["url"])]
    before_kill: dict[str, int] = {}

    async def run() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(agent(c, stop)) for c in created]
        await asyncio.sleep(3)
        before_kill.update({sid: len(turns) for sid, turns in acknowledged.items()})
        os.kill(victim["pid"], signal.SIGKILL)
        # until every session of the killed gateway has had two turns acknowledged since (by the
        # restarted gateway), or 60 s
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            len(acknowledged[sid]) >= before_kill[sid] + 2 for sid in on_victim
        ):
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    restarted = started.describe()[0]
    assert restarted["pid"] != victim["pid"]
    lost = 0
    for c in created:
        owner = c["base_url"].split("/sessions/")[0]
        exported = HTTP.get(f"{owner}/sessions/{c['session_id']}/export").json()
        stored = [b["tokens"] for b in exported["branches"]]
        for tokens in acknowledged[c["session_id"]]:
            lost += not any(branch[: len(tokens)] == tokens for branch in stored)
    assert lost == 0
    assert on_victim, "the killed gateway owned some of the sessions"
    assert all(len(acknowledged[sid]) >= before_kill[sid] + 2 for sid in on_victim), (
        "its sessions went on after the restart"
    )


def test_the_trajectory_queue_hands_over_every_finished_session_once(cluster: dict[str, Any]) -> None:
    from tokentape.ray import trajectories

    front = cluster["front"]
    ids = [f"finished-{i}" for i in range(5)]
    for session_id in ids:
        created = HTTP.post(f"{front}/sessions", json={"session_id": session_id}).json()
        asyncio.run(_turns(_sdk(created["base_url"]), 1))
        assert HTTP.post(f"{front}/sessions/{session_id}/finish").status_code == 200
    assert HTTP.post(f"{front}/sessions/{ids[0]}/finish").status_code in (200, 409)  # asked twice
    reader = trajectories("test")
    got: list[dict[str, Any]] = []
    while batch := reader.get(max_items=3, timeout=5):
        got += batch
    handed = [row["session_id"] for row in got if row["session_id"].startswith("finished-")]
    assert sorted(handed) == ids


def test_status_counts_what_the_shards_hold(cluster: dict[str, Any]) -> None:
    from typer.testing import CliRunner

    from tokentape.cli import app
    from tokentape.ray.cluster import cluster_status

    listed = HTTP.get(f"{cluster['front']}/sessions").json()["data"]
    state = cluster_status()
    assert [g["url"] for g in state["gateways"]] == list(cluster["gateways"].values())
    assert sum(g["open_sessions"] for g in state["gateways"]) == sum(not s["finished"] for s in listed)
    assert state["queues"]["test"]["capacity"] == 64
    shown = CliRunner().invoke(app, ["status"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert all(url in shown.output for url in cluster["gateways"].values())

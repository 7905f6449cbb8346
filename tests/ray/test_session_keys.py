"""Session keys on a cluster: two gateway actors and the front, with a trainer key. A session's key
works at every entry point (the front, either gateway, at the root or under its base URL) because a
request carrying a session key goes to the gateway that owns its session, which checks it there; it
reaches nothing else anywhere; the gateways' own hand-offs still run (they carry the trainer key)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.auth.walk import spoiled
from tests.ray.conftest import free_port_block
from tests.ray.test_cluster import Front
from tests.support.http_client import fresh_connections

HTTP = fresh_connections()  # one TLS context for the module's calls, a connection for each

MODEL = "smollm2-135m-instruct"
TRAINER = "ray-trainer-key"
T = {"authorization": f"Bearer {TRAINER}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tokentape.ray import RayOptions, ServeSpec, start_cluster

    first = free_port_block(3)
    started = start_cluster(
        ServeSpec(
            context_length=1024,
            threads=1,
            port=first,  # gateway i serves on first + 1 + i
            api_keys=(TRAINER,),
            ray=RayOptions(
                gateways=2,
                store_dir=str(tmp_path_factory.mktemp("keyed-shards")),
                trajectory_queue="keyed",
                engine_actors=1,
            ),
        )
    )
    front = Front(first)
    try:
        yield {"cluster": started, "front": front.url, "gateways": list(started.gateway_urls.values())}
    finally:
        front.stop()
        started.stop()


def test_a_session_key_works_on_every_gateway_and_reaches_nothing_else(keyed: dict[str, Any]) -> None:
    front, gateways = keyed["front"], keyed["gateways"]
    created = [HTTP.post(f"{front}/sessions", json={"session_id": f"rk-{i}"}, headers=T).json() for i in range(4)]
    owners = {c["base_url"].split("/sessions/")[0] for c in created}
    assert owners == set(gateways)  # the sessions spread over both gateways
    for c in created:
        name, agent = c["session_id"], {"authorization": f"Bearer {c['api_key']}"}
        other = next(o for o in created if o["session_id"] != name)
        for entry in [front, *gateways]:
            reply = HTTP.post(f"{entry}/v1/chat/completions", json=CHAT, headers=agent, timeout=60)
            assert reply.status_code == 200 and reply.headers["x-session-id"] == name, (entry, reply.text)
            based = HTTP.post(
                f"{entry}/sessions/{name}/v1/completions",
                json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                headers={"x-api-key": c["api_key"]},
                timeout=60,
            )
            assert based.status_code == 200, based.text
            for method, path in (
                ("POST", f"/sessions/{name}/reward"),
                ("POST", f"/sessions/{name}/finish"),
                ("GET", f"/sessions/{name}/export"),
                ("GET", "/sessions"),
                ("GET", "/export"),
                ("POST", "/sessions"),
                ("POST", "/admin/pause"),
                ("POST", f"/sessions/{other['session_id']}/v1/chat/completions"),
            ):
                refused = HTTP.request(method, f"{entry}{path}", json=CHAT, headers=agent, timeout=60)
                assert refused.status_code == 403, (entry, method, path, refused.text)
            assert HTTP.post(f"{entry}/v1/chat/completions", json=CHAT, timeout=60).status_code == 401
        summary = HTTP.get(f"{front}/sessions/{name}", headers=T).json()
        assert summary["turns"] == 6 and summary["reward"] is None and not summary["finished"]
    listed = HTTP.get(f"{front}/sessions", headers=T).json()["data"]
    assert sorted(s["session_id"] for s in listed) == [f"rk-{i}" for i in range(4)]


def test_finished_sessions_reach_the_queue_and_their_keys_stop(keyed: dict[str, Any]) -> None:
    from tokentape.ray import trajectories

    front = keyed["front"]
    created = HTTP.post(f"{front}/sessions", json={"session_id": "rk-done"}, headers=T).json()
    agent = {"authorization": f"Bearer {created['api_key']}"}
    assert HTTP.post(f"{front}/v1/chat/completions", json=CHAT, headers=agent, timeout=60).status_code == 200
    assert HTTP.post(f"{front}/sessions/rk-done/finish", headers=T, timeout=60).status_code == 200
    (handed,) = trajectories("keyed").get(max_items=1, timeout=30)  # the gateway's own export, keyed
    assert handed["session_id"] == "rk-done"
    for entry in [front, *keyed["gateways"]]:
        assert HTTP.post(f"{entry}/v1/chat/completions", json=CHAT, headers=agent, timeout=60).status_code == 409


def test_keys_work_again_after_their_gateway_is_killed(keyed: dict[str, Any]) -> None:
    import os
    import signal
    import time

    started, front = keyed["cluster"], keyed["front"]
    victim = started.describe()[0]
    created = [HTTP.post(f"{front}/sessions", json={"session_id": f"rk-kill-{i}"}, headers=T).json() for i in range(4)]
    owned = [c for c in created if c["base_url"].startswith(victim["url"])]
    assert owned, "the gateway killed owns some of the sessions"
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while started.describe()[0]["pid"] == victim["pid"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started.describe()[0]["pid"] != victim["pid"]
    for c in owned:  # the restarted gateway knows each key from the digest in its shard
        agent = {"authorization": f"Bearer {c['api_key']}"}
        for entry in [front, *keyed["gateways"]]:
            reply = HTTP.post(f"{entry}/v1/chat/completions", json=CHAT, headers=agent, timeout=60)
            assert reply.status_code == 200 and reply.headers["x-session-id"] == c["session_id"], reply.text
        refused = HTTP.post(f"{front}/sessions/{c['session_id']}/reward", json={"reward": 1}, headers=agent)
        assert refused.status_code == 403
        wrong = {"authorization": f"Bearer {spoiled(c['api_key'])}"}
        assert HTTP.post(f"{front}/v1/chat/completions", json=CHAT, headers=wrong, timeout=60).status_code == 401

"""Session keys are secrets that last: a key works after kill -9 and a restart of `tokentape serve`,
the store holds its SHA-256 digest and never the key; one key's requests in flight can be capped; the
in-process gateway hands its agents their session's key, never the trainer's."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from pathlib import Path

import httpx
import openai
import pytest

from tests.auth.walk import MODEL, TRAINER, spoiled
from tests.support.gates import GatedEngine
from tokentape.client import InProcessGateway
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.launcher import running_server
from tokentape.render.renderer import Renderer
from tokentape.served import ServeSpec, build_served
from tokentape.store.sqlite import SqliteStore

T = {"authorization": f"Bearer {TRAINER}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def store_bytes(store: Path) -> bytes:
    """The database and its write-ahead log, as they lie on disk."""
    return b"".join(p.read_bytes() for p in sorted(store.parent.iterdir()) if p.name.startswith(store.name))


async def test_keys_survive_kill_minus_nine_and_only_their_digest_is_stored(
    tmp_path: Path, engine: LlamaCppEngine, renderer: Renderer
) -> None:
    store = tmp_path / "keys.sqlite3"
    args = ["--store", str(store), "--api-key", TRAINER]
    with running_server(args) as server:
        created = httpx.post(f"{server.base_url}/sessions", json={"session_id": "durable-key"}, headers=T).json()
        key = created["api_key"]
        agent = {"authorization": f"Bearer {key}"}
        assert httpx.post(f"{server.base_url}/v1/chat/completions", json=CHAT, headers=agent).status_code == 200
        # a second session finished before the kill: finished stays finished for its key across a restart
        created = httpx.post(f"{server.base_url}/sessions", json={"session_id": "done-key"}, headers=T).json()
        done = {"authorization": f"Bearer {created['api_key']}"}
        assert httpx.post(f"{server.base_url}/v1/chat/completions", json=CHAT, headers=done).status_code == 200
        assert httpx.post(f"{server.base_url}/sessions/done-key/finish", headers=T).status_code == 200
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
    on_disk = store_bytes(store)
    for secret in (key, created["api_key"]):
        assert secret.encode() not in on_disk and secret.split(".")[-1].encode() not in on_disk
        assert hashlib.sha256(secret.encode()).digest() in on_disk
    # restarted on the same store: a gateway in this process, on the shared model, instead of a second
    # `tokentape serve`
    spec = ServeSpec(served_model_name=MODEL, api_keys=(TRAINER,))
    built = build_served(spec, engine=engine, renderer=renderer, store=SqliteStore(store))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=built.app), base_url="http://t") as http:
        reply = await http.post("/v1/chat/completions", json=CHAT, headers=agent)
        assert reply.status_code == 200 and reply.headers["x-session-id"] == "durable-key"
        assert (await http.get("/sessions/durable-key", headers=T)).json()["turns"] == 2
        assert (await http.post("/sessions/durable-key/reward", json={"reward": 1}, headers=agent)).status_code == 403
        wrong = {"authorization": f"Bearer {spoiled(key)}"}
        assert (await http.post("/v1/chat/completions", json=CHAT, headers=wrong)).status_code == 401
        refused = await http.post("/v1/chat/completions", json=CHAT, headers=done)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_finished"
        assert (await http.get("/sessions/done-key", headers=T)).json()["turns"] == 1
        assert (await http.post("/sessions/durable-key/finish", headers=T)).status_code == 200
        assert (await http.post("/v1/chat/completions", json=CHAT, headers=agent)).status_code == 409
    built.gateway.sessions.store.close()
    assert key.encode() not in store_bytes(store)


async def test_a_cap_on_one_keys_requests_in_flight(engine: LlamaCppEngine, renderer: Renderer) -> None:
    gated = GatedEngine(engine)
    spec = ServeSpec(served_model_name=MODEL, api_keys=(TRAINER,), max_in_flight_per_key=1)
    app = build_served(spec, engine=gated, renderer=renderer).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        one = (await http.post("/sessions", json={"session_id": "capped"}, headers=T)).json()["api_key"]
        two = (await http.post("/sessions", json={"session_id": "free"}, headers=T)).json()["api_key"]
        gated.gate.clear()
        held = asyncio.create_task(
            http.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {one}"})
        )
        await gated.entered.wait()
        refused = await http.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {one}"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        message = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
        refused = await http.post("/v1/messages", json=message, headers={"x-api-key": one})
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"  # Anthropic's
        other = asyncio.create_task(
            http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1}, headers={"x-api-key": two}
            )
        )
        gated.gate.set()
        assert (await held).status_code == 200 and (await other).status_code == 200
        again = await http.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {one}"})
        assert again.status_code == 200  # its slot came back
        assert (await http.get("/sessions/capped", headers=T)).json()["turns"] == 2


async def test_the_in_process_gateway_hands_agents_their_session_key(
    engine: LlamaCppEngine, renderer: Renderer
) -> None:
    spec = ServeSpec(served_model_name=MODEL, api_keys=(TRAINER,))
    client = InProcessGateway(spec, engine=engine, renderer=renderer)
    try:
        await client.create_session("handed", group_id="g")
        agent = client.client("handed")
        assert agent.api_key == client.session_key("handed") and agent.api_key != TRAINER
        reply = await agent.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.choices[0].message is not None
        with pytest.raises(openai.PermissionDeniedError):
            await agent.with_options(base_url="http://tokentape.local").post(
                "/sessions/handed/reward", body={"reward": 1.0}, cast_to=object
            )
        with pytest.raises(ValueError, match="create_session"):
            client.client("never-created")  # no key of its own: never the trainer's instead
        await client.finish("handed", reward=1.0)  # the trainer's own calls carry the trainer key
        assert (await client.export("handed"))["branches"][0]["reward"] == 1.0
    finally:
        await client.aclose()

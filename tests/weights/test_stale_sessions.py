"""Bounded staleness on the live gateway: a session that began more than K versions ago is refused
(409 session_stale) and marked stale in its export; admission control refuses a new group with 429
while admitting it would exceed (K + version + 1) x B groups."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokentape.core.staleness import GroupAdmission, Staleness
from tokentape.gateway.service import Gateway
from tokentape.served import ServeSpec


def built_with(staleness: Staleness) -> pytest.MarkDecorator:
    """`fresh` built with this bound, as `serve --max-staleness --admit-per-version --admission-wait` build it."""
    return pytest.mark.parametrize("spec", [ServeSpec(served_model_name="smollm2", staleness=staleness)])


BODY = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@built_with(Staleness(max_staleness=1))
async def test_a_session_older_than_max_staleness_gets_no_new_turns(
    fresh: Gateway, admin: httpx.AsyncClient, adapters: list[Path]
) -> None:
    assert (await admin.post("/sessions/old/v1/chat/completions", json=BODY)).status_code == 200  # version 0
    await admin.post("/sessions", json={"session_id": "strict", "metadata": {"max_staleness": 0}})
    assert (await admin.post("/sessions/strict/v1/chat/completions", json=BODY)).status_code == 200
    await fresh.update_weights(1, lora=str(adapters[0]))
    # K = 1: one version behind is fine; the session with its own K = 0 is not
    assert (await admin.post("/sessions/old/v1/chat/completions", json=BODY)).status_code == 200
    refused = await admin.post("/sessions/strict/v1/chat/completions", json=BODY)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_stale"
    await fresh.update_weights(2, lora=str(adapters[1]))
    refused = await admin.post("/sessions/old/v1/chat/completions", json=BODY)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_stale"
    assert "began under version 0" in refused.json()["error"]["message"]
    exported = (await admin.get("/sessions/old/export")).json()
    assert sum(len(b["action_ranges"]) for b in exported["branches"]) == 2  # its turns are all there
    assert [b["versions"][b["action_ranges"][0][0]] for b in exported["branches"]] == [0, 1]
    summary = (await admin.get("/sessions/old")).json()
    assert summary["metadata"]["stale"] is True
    # a new session starts fine at the current version
    assert (await admin.post("/sessions/new/v1/chat/completions", json=BODY)).status_code == 200


@built_with(Staleness(max_staleness=0, admit_per_version=2))  # (0 + v + 1) x 2 groups
async def test_admission_refuses_a_new_group_past_the_limit(
    fresh: Gateway, admin: httpx.AsyncClient, adapters: list[Path]
) -> None:
    for group in ("a", "b"):
        await admin.post("/sessions", json={"session_id": f"{group}1", "group_id": group})
        assert (await admin.post(f"/sessions/{group}1/v1/chat/completions", json=BODY)).status_code == 200
    await admin.post("/sessions", json={"session_id": "a2", "group_id": "a"})  # a known group: admitted
    assert (await admin.post("/sessions/a2/v1/chat/completions", json=BODY)).status_code == 200
    await admin.post("/sessions", json={"session_id": "c1", "group_id": "c"})
    refused = await admin.post("/sessions/c1/v1/chat/completions", json=BODY)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "admission_closed"
    assert refused.headers["retry-after"]
    await fresh.update_weights(1, lora=str(adapters[0]))
    assert (await admin.post("/sessions/c1/v1/chat/completions", json=BODY)).status_code == 200


@built_with(Staleness(max_staleness=5))  # the gateway's bound; each session below has its own
async def test_max_staleness_is_a_field_of_the_session(
    fresh: Gateway, admin: httpx.AsyncClient, adapters: list[Path]
) -> None:
    created = await admin.post("/sessions", json={"session_id": "own", "max_staleness": 0})
    assert created.status_code == 201 and created.json()["max_staleness"] == 0
    assert (await admin.get("/sessions/own")).json()["max_staleness"] == 0
    listed = (await admin.get("/sessions", params={"limit": 10})).json()["data"]
    assert [s["max_staleness"] for s in listed if s["session_id"] == "own"] == [0]
    both = await admin.post(
        "/sessions", json={"session_id": "both", "max_staleness": 1, "metadata": {"max_staleness": 1}}
    )
    assert both.json()["max_staleness"] == 1
    plain = await admin.post("/sessions", json={"session_id": "plain"})
    assert plain.json()["max_staleness"] is None  # the gateway's --max-staleness applies
    for name in ("own", "both", "plain"):
        assert (await admin.post(f"/sessions/{name}/v1/chat/completions", json=BODY)).status_code == 200
    await fresh.update_weights(1, lora=str(adapters[0]))
    refused = await admin.post("/sessions/own/v1/chat/completions", json=BODY)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_stale"
    assert "max_staleness is 0" in refused.json()["error"]["message"]
    for name in ("both", "plain"):
        assert (await admin.post(f"/sessions/{name}/v1/chat/completions", json=BODY)).status_code == 200
    await fresh.update_weights(2, lora=str(adapters[1]))
    refused = await admin.post("/sessions/both/v1/chat/completions", json=BODY)
    assert refused.status_code == 409 and "max_staleness is 1" in refused.json()["error"]["message"]
    assert (await admin.post("/sessions/plain/v1/chat/completions", json=BODY)).status_code == 200


async def test_a_bad_max_staleness_is_a_400_and_creates_nothing(fresh: Gateway, admin: httpx.AsyncClient) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_staleness": 1.5}, "max_staleness"),
        ({"max_staleness": "2"}, "max_staleness"),
        ({"max_staleness": True}, "max_staleness"),
        ({"metadata": {"max_staleness": -2}}, "metadata.max_staleness"),
        ({"max_staleness": 1, "metadata": {"max_staleness": 2}}, "max_staleness"),
    ]
    for body, param in cases:
        refused = await admin.post("/sessions", json={"session_id": "bad", **body})
        assert refused.status_code == 400, body
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, body
        assert (await admin.get("/sessions/bad")).status_code == 404


@built_with(Staleness(max_staleness=0, admit_per_version=1, admission_wait=30.0))  # 1 group at v0
async def test_a_new_group_waits_for_a_version_bump_before_its_429(
    fresh: Gateway, admin: httpx.AsyncClient, adapters: list[Path]
) -> None:
    assert (await admin.post("/sessions/g1/v1/chat/completions", json=BODY)).status_code == 200
    waiting = asyncio.create_task(admin.post("/sessions/g2/v1/chat/completions", json=BODY))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # no room at version 0: it waits instead of a 429
    started = time.monotonic()
    await fresh.update_weights(1, lora=str(adapters[0]))  # (0 + 1 + 1) x 1: room for one more group
    answer = await asyncio.wait_for(waiting, 30)
    assert answer.status_code == 200 and time.monotonic() - started < 5
    (branch,) = (await admin.get("/sessions/g2/export")).json()["branches"]
    assert {v for v in branch["versions"] if v >= 0} == {1}  # admitted, and sampled, under the new version
    # a bump that makes no room for it: the wait goes on, and ends in the 429 when its time is up
    fresh.staleness = dataclasses.replace(
        fresh.staleness, admission_wait=0.6
    )  # a shorter wait, set in place for the rest of this test
    fresh.group_admission = GroupAdmission(0, 1)
    fresh.group_admission.count += 3  # 4 admitted, room for 2
    started = time.monotonic()
    asking = asyncio.create_task(admin.post("/sessions/g3/v1/chat/completions", json=BODY))
    await asyncio.sleep(0.2)
    await fresh.update_weights(2, lora=str(adapters[1]))  # room for 3 groups: still none for a 6th
    refused = await asking
    waited = time.monotonic() - started
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "admission_closed"
    assert 0.6 <= waited < 5
    # without a wait: refused at once
    fresh.staleness = dataclasses.replace(fresh.staleness, admission_wait=0.0)
    fresh.group_admission = GroupAdmission(0, 1)
    fresh.group_admission.count += 3  # (0 + 2 + 1) x 1: full
    started = time.monotonic()
    assert (await admin.post("/sessions/g4/v1/chat/completions", json=BODY)).status_code == 429
    assert time.monotonic() - started < 0.5

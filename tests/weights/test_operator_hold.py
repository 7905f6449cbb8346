"""An operator's pause outlives a weight update that lands meanwhile, and versions only grow."""

from __future__ import annotations

import asyncio

import httpx

from tests.support.served import build
from tests.support.weights import RefusingEngine
from tokentape.engines.weights import WeightSource
from tokentape.render.renderer import Renderer


class SlowLoad(RefusingEngine):
    """Loads once it is let go, so that an operator can pause while the update runs."""

    def __init__(self) -> None:
        super().__init__(loads_ok=10)
        self.loading = asyncio.Event()
        self.go = asyncio.Event()

    async def load_weights(self, source: WeightSource, version: int) -> None:
        self.loading.set()
        await self.go.wait()
        await super().load_weights(source, version)


async def test_a_pause_sent_while_an_update_runs_stays_after_it(renderer: Renderer) -> None:
    engine = SlowLoad()
    app = build(engine, renderer, model="stand-in").app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as admin:
        update = asyncio.create_task(admin.post("/admin/weights", json={"version": 1, "engine_managed": True}))
        await asyncio.wait_for(engine.loading.wait(), 30)
        assert (await admin.post("/admin/pause", json={})).status_code == 200
        engine.go.set()
        answer = await asyncio.wait_for(update, 30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["still_paused"] is True
        state = (await admin.get("/admin/status")).json()
        assert (state["paused"], state["weights_version"]) == (True, 1)
        assert (await admin.post("/admin/resume", json={})).status_code == 200
        assert (await admin.get("/admin/status")).json()["paused"] is False


async def test_resume_cannot_move_the_version_back(renderer: Renderer) -> None:
    app = build(RefusingEngine(loads_ok=10), renderer, model="stand-in").app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as admin:
        assert (await admin.post("/admin/weights", json={"version": 4, "engine_managed": True})).status_code == 200
        await admin.post("/admin/pause", json={})
        back = await admin.post("/admin/resume", json={"policy_version": 2})
        assert back.status_code == 409 and back.json()["error"]["code"] == "version_not_new"
        state = (await admin.get("/admin/status")).json()
        assert (state["paused"], state["weights_version"]) == (True, 4)  # nothing changed
        assert (await admin.post("/admin/resume", json={"policy_version": 5})).status_code == 200
        assert (await admin.get("/admin/status")).json()["weights_version"] == 5

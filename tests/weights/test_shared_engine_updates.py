"""A gateway of a Ray cluster over remote engines shares them with the other gateways, which it cannot
hold: its weight update is refused before anything changes."""

from __future__ import annotations

import httpx

from tests.support.weights import RefusingEngine
from tokentape.ray.actors import SharedEngineUpdates
from tokentape.render.renderer import Renderer
from tokentape.served import ServeSpec, build_served


async def test_an_update_over_shared_remote_engines_is_refused_and_changes_nothing(renderer: Renderer) -> None:
    engine = RefusingEngine(loads_ok=10)
    spec = ServeSpec(served_model_name="stand-in")
    app = build_served(spec, engine=engine, renderer=renderer, updates=SharedEngineUpdates).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as admin:
        answer = await admin.post("/admin/weights", json={"version": 1, "engine_managed": True})
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "update_unsupported"
        state = (await admin.get("/admin/status")).json()
        assert (state["paused"], state["weights_version"]) == (False, 0)
    assert engine.steps == []  # not checked, paused or loaded

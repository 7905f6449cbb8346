"""Every way out of a weight update leaves the engines serving and the operator's word standing: a
rollback keeps an operator's pause, a caller cancelled mid-update leaves no engine paused, a bad path
is a 400 naming it, and the file checked against `--weights-dir` is the file the engines load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.served import build
from tests.support.weights import RefusingEngine
from tokentape.engines.weights import InFlight, WeightSource, WeightUpdateFailed
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.gateway.updates import WeightUpdate
from tokentape.render.renderer import Renderer
from tokentape.store.sqlite import SqliteStore


class FailsTheNewVersion(RefusingEngine):
    """Loads its current version again (a rollback) but not a new one."""

    async def load_weights(self, source: WeightSource, version: int) -> None:
        self.steps.append(f"load {version}")
        if version > self.version:
            raise WeightUpdateFailed("the stand-in refuses new weights")


class LoadsForever(RefusingEngine):
    """Pauses, then never finishes loading: the update's caller is cancelled meanwhile."""

    def __init__(self) -> None:
        super().__init__(loads_ok=10)
        self.loading = asyncio.Event()
        self.paused = False

    async def pause_generation(self, in_flight: InFlight) -> None:
        await super().pause_generation(in_flight)
        self.paused = True

    async def load_weights(self, source: WeightSource, version: int) -> None:
        self.steps.append(f"load {version}")
        if version > self.version:
            self.loading.set()
            await asyncio.Event().wait()

    async def resume_generation(self, *, fresh_kv: bool) -> None:
        await super().resume_generation(fresh_kv=fresh_kv)
        self.paused = False


async def test_a_rollback_keeps_an_operators_pause(renderer: Renderer) -> None:
    engine = FailsTheNewVersion()
    app = build(engine, renderer, model="stand-in").app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as admin:
        failed = await admin.post("/admin/weights", json={"version": 1, "model": "/weights/new.gguf"})
        assert failed.status_code == 502, failed.text
        assert (await admin.post("/admin/pause", json={})).status_code == 200  # the operator holds
        rolled = await admin.post("/admin/rollback", json={})
        assert rolled.status_code == 200, rolled.text
        assert rolled.json()["still_paused"] is True
        state = (await admin.get("/admin/status")).json()
        assert (state["paused"], state["weights_version"]) == (True, 0)
        assert (await admin.post("/admin/resume", json={})).status_code == 200
        assert (await admin.get("/admin/status")).json()["paused"] is False


async def test_a_rollback_without_a_pause_releases_generation(renderer: Renderer) -> None:
    app = build(FailsTheNewVersion(), renderer, model="stand-in").app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as admin:
        await admin.post("/admin/weights", json={"version": 1, "model": "/weights/new.gguf"})
        assert (await admin.get("/admin/status")).json()["paused"] is True  # held by the failure
        rolled = await admin.post("/admin/rollback", json={})
        assert rolled.json()["still_paused"] is False
        assert (await admin.get("/admin/status")).json()["paused"] is False


async def test_a_cancelled_update_leaves_every_engine_resumed(renderer: Renderer) -> None:
    engine = LoadsForever()
    gateway = Gateway(engine, renderer, SessionRegistry(SqliteStore(":memory:")))
    update = asyncio.create_task(gateway.updates.update(_update(1)))
    await asyncio.wait_for(engine.loading.wait(), 10)
    assert engine.paused
    update.cancel()
    with pytest.raises(asyncio.CancelledError):
        await update
    assert not engine.paused
    after_load = engine.steps[engine.steps.index("load 1") + 1 :]
    assert after_load[:2] == ["load 0", "resume"]  # the old weights back, then running again
    assert "generate" in after_load  # and probed
    assert gateway.updates.running is False and gateway.gate.version == 0
    gateway.updates.check_resumable()  # the old weights are back everywhere: resume is allowed


async def test_a_path_no_file_can_have_is_a_400_naming_it(renderer: Renderer) -> None:
    app = build(RefusingEngine(loads_ok=10), renderer, model="stand-in", weights_dirs=(Path("/weights"),)).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as admin:
        for path in ("/weights/a\0b.gguf", "/weights/" + "x" * 5000):
            refused = await admin.post("/admin/weights", json={"version": 1, "lora": path})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "lora"
        assert (await admin.get("/admin/status")).json()["weights_version"] == 0


class SwapsTheLink(RefusingEngine):
    """Swaps a symbolic link to a file outside the allowed directory while paused, then records
    the path it is asked to load."""

    def __init__(self, link: Path, outside: Path) -> None:
        super().__init__(loads_ok=10)
        self.link, self.outside = link, outside
        self.loaded: list[str | None] = []

    async def pause_generation(self, in_flight: InFlight) -> None:
        await super().pause_generation(in_flight)
        self.link.unlink()
        self.link.symlink_to(self.outside)

    async def load_weights(self, source: WeightSource, version: int) -> None:
        self.loaded.append(source.path)
        await super().load_weights(source, version)


async def test_the_file_checked_is_the_file_loaded(renderer: Renderer, tmp_path: Path) -> None:
    allowed = tmp_path / "adapters"
    allowed.mkdir()
    inside, outside = allowed / "step-1.gguf", tmp_path / "secret.gguf"
    inside.write_bytes(b"GGUF")
    outside.write_bytes(b"GGUF")
    link = allowed / "latest.gguf"
    link.symlink_to(inside)
    engine = SwapsTheLink(link, outside)
    app = build(engine, renderer, model="stand-in", weights_dirs=(allowed,)).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as admin:
        done = await admin.post("/admin/weights", json={"version": 1, "lora": str(link)})
        assert done.status_code == 200, done.text
    assert engine.loaded == [str(inside.resolve())]  # not the link, which now points outside


def _update(version: int) -> WeightUpdate:
    return WeightUpdate(version, WeightSource("model", "/weights/new.gguf"))

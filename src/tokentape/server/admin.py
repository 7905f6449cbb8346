"""Operator routes: pause and resume generation around weight updates, and the engine pool."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from tokentape.engines.remote import make_engine
from tokentape.engines.router import Router
from tokentape.errors import InvalidRequest
from tokentape.gateway.service import Gateway
from tokentape.server.sessions_api import json_object

__all__ = ["add_admin_routes"]


def add_admin_routes(app: FastAPI, gateway: Gateway) -> None:
    def router() -> Router:
        if not isinstance(gateway.engine, Router):
            raise InvalidRequest("this gateway runs the embedded engine; start it with --engine to manage engines")
        return gateway.engine

    def status() -> dict[str, Any]:
        engines = gateway.engine.describe() if isinstance(gateway.engine, Router) else []
        return {
            "paused": gateway.paused,
            "policy_version": gateway.policy_version,
            "requests_active": gateway.active,
            "engines": engines,
        }

    @app.get("/admin/status")
    async def admin_status() -> dict[str, Any]:
        return status()

    @app.post("/admin/pause")
    async def pause(request: Request) -> dict[str, Any]:
        """Hold new generations; `{"abort": true}` also stops running ones at their next token."""
        data = await json_object(request, optional=True)
        abort = data.get("abort", False)
        if not isinstance(abort, bool):
            raise InvalidRequest("abort must be true or false", param="abort")
        gateway.pause(abort=abort)
        return status()

    @app.post("/admin/resume")
    async def resume(request: Request) -> dict[str, Any]:
        """Release held generations; `{"policy_version": ...}` labels every turn sampled from now on."""
        data = await json_object(request, optional=True)
        version = data.get("policy_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
            raise InvalidRequest("policy_version must be a string or an integer", param="policy_version")
        gateway.resume(None if version is None else str(version))
        return status()

    @app.get("/admin/engines")
    async def engines() -> dict[str, Any]:
        return {"object": "list", "data": router().describe()}

    @app.post("/admin/engines")
    async def change_engines(request: Request) -> dict[str, Any]:
        """`{"add": "vllm=http://host:port"}` or `{"drain": "http://host:port"}`."""
        data = await json_object(request)
        pool = router()
        if isinstance(data.get("add"), str):
            engine = make_engine(data["add"])
            await engine.discover()
            await engine.check_health()
            pool.add(engine)
        elif isinstance(data.get("drain"), str):
            engine = pool.find(data["drain"])
            engine.draining = True  # no new work from now on, before this answer goes out
            task = asyncio.create_task(pool.remove_when_drained(engine))
            app.state.drains = [*getattr(app.state, "drains", []), task]  # keep a reference while it runs
        else:
            raise InvalidRequest('send {"add": "KIND=URL"} or {"drain": "URL"}', param="add")
        return {"object": "list", "data": pool.describe()}

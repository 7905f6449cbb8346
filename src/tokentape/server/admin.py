"""Operator routes: weight updates (atomic over every engine), pause and resume, and the engine pool.

POST /admin/weights   {"version": N, "lora": PATH | "model": PATH | "engine_managed": true,
                       "in_flight": "continue" | "keep" | "abort"}: the phases' durations, or an
                       error naming the problem (400/409 before anything paused; 502 naming the
                       engine that failed, the gateway then held until resume or rollback);
                       403 for a path outside the directories the operator allows (--weights-dir)
POST /admin/rollback  after a failed update: the current version's weights again on every engine
POST /admin/pause, /admin/resume: hold and release by hand (resume's policy_version: a label; an
                       integer, or a string that is one, is also the weights version)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from tokentape.engines.weights import WeightSource
from tokentape.errors import Forbidden, InvalidRequest
from tokentape.gateway.service import Gateway
from tokentape.gateway.updates import parse_update
from tokentape.server.bodies import json_object

__all__ = ["add_admin_routes", "check_weights_dir"]


def check_weights_dir(source: WeightSource, allowed: Sequence[Path] | None) -> WeightSource:
    """Weights load only from the directories the operator allows (None: any): Forbidden naming the
    rule otherwise. The path is resolved first (`..` and symbolic links cannot step outside), and the
    source returned names the resolved path: the file checked is the file loaded, even if a link on
    the way is swapped before the engines load it."""
    if allowed is None or source.path is None:
        return source
    resolved = Path(source.path).resolve()
    if not any(resolved.is_relative_to(folder) for folder in allowed):
        folders = ", ".join(str(folder) for folder in allowed) or "none"
        raise Forbidden(
            f"{source.kind} {source.path!r} is outside the directories weights may be loaded from ({folders}); "
            "the operator allows more with `tokentape serve --weights-dir DIR`",
            param=source.kind,
            code="weights_dir_forbidden",
        )
    return dataclasses.replace(source, path=str(resolved))


def add_admin_routes(app: FastAPI, gateway: Gateway, weights_dirs: Sequence[Path] | None = None) -> None:
    def status() -> dict[str, Any]:
        stats = gateway.stats()
        return {
            "paused": stats.paused,
            "policy_version": stats.policy_version,
            "weights_version": stats.weights_version,
            "updating": gateway.updates.running,
            "last_update": gateway.updates.last,
            "requests_active": stats.requests_active,
            "engine": stats.engine,
        }

    @app.get("/admin/status")
    async def admin_status() -> dict[str, Any]:
        """Whether generation is paused, the policy and weights versions, the update running or last
        done, requests running, and the engine's own counters."""
        return status()

    @app.post("/admin/weights")
    async def weights(request: Request) -> dict[str, Any]:
        """Load new weights on every engine and switch the version, atomically."""
        update = parse_update(await json_object(request))
        update = dataclasses.replace(update, source=check_weights_dir(update.source, weights_dirs))
        report = await gateway.updates.update(update)
        return {**report, "status": status()}

    @app.post("/admin/rollback")
    async def rollback(request: Request) -> dict[str, Any]:
        """After a failed weight update: load the current version's weights again on every engine and
        release generation; 409 if no update failed or one is running."""
        report = await gateway.updates.rollback()
        return {**report, "status": status()}

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
        gateway.resume(version)
        return status()

    @app.get("/admin/engines")
    async def engines() -> dict[str, Any]:
        """The remote engines the gateway routes to, each with its kind, URL, health, whether it is
        draining, and its load (requests in flight, sessions pinned, tokens generated)."""
        return {"object": "list", "data": gateway.pool()}

    @app.post("/admin/engines")
    async def change_engines(request: Request) -> dict[str, Any]:
        """`{"add": "vllm=http://host:port"}` or `{"drain": "http://host:port"}`."""
        data = await json_object(request)
        if isinstance(data.get("add"), str):
            await gateway.add_engine(data["add"])
        elif isinstance(data.get("drain"), str):
            gateway.drain_engine(data["drain"])  # no new work from now on, before this answer goes out
        else:
            gateway.pool()  # an embedded gateway says so first
            raise InvalidRequest('send {"add": "KIND=URL"} or {"drain": "URL"}', param="add")
        return {"object": "list", "data": gateway.pool()}

"""The cluster's actors: the session directory, the gateways (each serving the HTTP API on its own
port and owning its sessions and its store shard) and the trajectory queue a trainer reads.

Names are fixed per namespace so any process of the cluster finds them with `ray.get_actor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from tokentape.engines.base import Engine
from tokentape.engines.weights import InFlight
from tokentape.errors import Conflict, TokentapeError
from tokentape.gateway.updates import WeightUpdate, WeightUpdater
from tokentape.gateway.versions import VersionGate
from tokentape.ray.asgi import HttpRequest, ResponseStart, collect
from tokentape.ray.placement import SessionPlacement
from tokentape.ray.routing import OwnerRouting
from tokentape.served import ServeSpec

__all__ = [
    "NAMESPACE",
    "DIRECTORY",
    "SessionDirectory",
    "GatewayActor",
    "GatewayActorClass",
    "SessionDirectoryActor",
    "TrajectoryQueueActor",
    "TrajectoryQueue",
    "RayPeers",
    "ClusterUpdates",
    "gateway_name",
    "queue_name",
]

NAMESPACE = "tokentape"
DIRECTORY = "tokentape-directory"


def gateway_name(index: int) -> str:
    return f"tokentape-gateway-{index}"


def queue_name(name: str) -> str:
    return f"tokentape-trajectories-{name}"


class SessionDirectory:
    """Which gateway owns which session. It holds no tape: if it restarts, it learns placements
    again by asking the gateways, whose shards hold every session they own."""

    def __init__(self) -> None:
        self.placement = SessionPlacement()

    async def join(self, index: int, url: str) -> None:
        self.placement.add_gateway(index, url)

    async def gateways(self) -> dict[int, str]:
        return dict(sorted(self.placement.urls.items()))  # by index, whatever order they joined in

    async def owner(self, session_id: str, group_id: str | None = None) -> int:
        known = self.placement.owner(session_id)
        if known is not None:
            return known
        holders: list[bool] = await asyncio.gather(
            *(ray.get_actor(gateway_name(i), namespace=NAMESPACE).holds.remote(session_id) for i in self.placement.urls)
        )
        for index, holds in zip(list(self.placement.urls), holders, strict=True):
            if holds:
                self.placement.record(session_id, index, group_id)
                return index
        return self.placement.place(session_id, group_id)

    async def least_loaded(self) -> int:
        load = self.placement.load()
        if not load:
            raise LookupError("no gateway has joined the cluster")
        return min(load, key=lambda index: (load[index], index))

    async def finished(self, session_id: str) -> None:
        self.placement.finished(session_id)

    async def forget(self, session_id: str) -> None:
        self.placement.forget(session_id)

    async def load(self) -> dict[int, int]:
        return self.placement.load()


class RayPeers:
    """`Peers` over Ray: the directory decides, gateway actors answer."""

    def __init__(self, self_index: int | None) -> None:
        self._self_index = self_index
        self.directory = ray.get_actor(DIRECTORY, namespace=NAMESPACE)
        self._owners: dict[str, int] = {}  # a cache: ownership never changes once placed
        self._handles: dict[int, Any] = {}

    @property
    def self_index(self) -> int | None:
        return self._self_index

    async def owner(self, session_id: str, group_id: str | None = None) -> int:
        if (index := self._owners.get(session_id)) is None:
            index = await self.directory.owner.remote(session_id, group_id)
            if len(self._owners) > 200_000:
                self._owners.clear()
            self._owners[session_id] = index
        return index

    async def least_loaded(self) -> int:
        index: int = await self.directory.least_loaded.remote()
        return index

    async def gateways(self) -> dict[int, str]:
        urls: dict[int, str] = await self.directory.gateways.remote()
        return urls

    def _gateway(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = ray.get_actor(gateway_name(index), namespace=NAMESPACE)
        return self._handles[index]

    async def forward(self, index: int, request: HttpRequest) -> AsyncIterator[ResponseStart | bytes]:
        owner = self._gateway(index)
        request_id = uuid.uuid4().hex
        stream = owner.handle.remote(request, request_id)
        done = False
        try:
            async for ref in stream:
                yield await ref
            done = True
        finally:
            if not done:
                # The client left: the owner's app sees a disconnect and aborts the generation (which
                # records the aborted turn). Said explicitly, not left to the cancel alone: a cancel that
                # does not reach the owner's coroutine would leave the generation running unread.
                owner.disconnect.remote(request_id)
                ray.cancel(stream)

    async def finished(self, session_id: str) -> None:
        await self.directory.finished.remote(session_id)

    async def forget(self, session_id: str) -> None:
        self._owners.pop(session_id, None)
        await self.directory.forget.remote(session_id)


class GatewayActor:
    """One gateway: its sessions in memory, its turns in its shard, the HTTP API on its port. Killed,
    Ray starts it again with the same spec: it reloads its shard and serves the same URL."""

    async def __init__(self, spec: ServeSpec, index: int) -> None:  # type: ignore[misc]  # Ray awaits an async actor's __init__
        """Gateway `index` of the cluster `spec` describes, its store shard at `spec.store`."""
        import functools

        import uvicorn

        from tokentape.engines.remote import make_engine
        from tokentape.ray.engines import ENGINE_REGISTRY, ActorEngine, SharedRouter, engine_actor_name
        from tokentape.served import RayOptions, build_served

        self.spec, self.index = spec, index
        options = spec.ray or RayOptions()
        Path(spec.store).parent.mkdir(parents=True, exist_ok=True)
        engines = [make_engine(s) for s in spec.engines] or [
            ActorEngine(engine_actor_name(i)) for i in range(options.engine_actors)
        ]
        registry = ray.get_actor(ENGINE_REGISTRY, namespace=NAMESPACE)
        router = SharedRouter(engines, registry)
        if spec.engines:  # remote engines shared by every gateway: this one alone cannot hold the others
            served = build_served(
                spec, engine=router, updates=SharedEngineUpdates, owns_gateway=True, serving_process=True
            )
        else:  # engine actors: the registry updates them for the whole cluster
            updates = functools.partial(ClusterUpdates, registry=registry, engine_actors=options.engine_actors)
            # a gateway (re)started after an update: the engine actors hold the cluster's version
            version = int((await registry.describe.remote())["weights_version"])
            served = build_served(
                spec, engine=router, updates=updates, version=version, owns_gateway=True, serving_process=True
            )
        # every gateway switches version together, so the spec's staleness bound means the same on each
        self.gateway = served.gateway
        self.app = served.app
        trainer = spec.trainer_key
        # this gateway's own calls to its app (hand-offs to the trajectory queue) are a trainer's
        self._own: tuple[tuple[bytes, bytes], ...] = ()
        if trainer:
            self._own = ((b"authorization", f"Bearer {trainer}".encode()),)
        self.trajectory_queue = options.trajectory_queue
        self.peers = RayPeers(index)
        self._forwarded: dict[str, asyncio.Event] = {}  # request id -> set when its client leaves
        self.routing = OwnerRouting(
            self.app,
            self.peers,
            on_finish=self._hand_off if self.trajectory_queue else None,
            max_body_bytes=spec.max_body_bytes,
        )
        port = spec.port + 1 + index
        self.url = f"http://{spec.host}:{port}"
        # bounded as `tokentape serve` is; its access lines would go to Ray's log stream
        served_as = {**spec.uvicorn_options(), "log_level": "warning", "access_log": False}
        config = uvicorn.Config(self.routing, host=spec.host, port=port, lifespan="on", **served_as)
        self.server = uvicorn.Server(config)
        # Bound here, so a port in use fails this constructor with a clear error (uvicorn would exit
        # the actor's event loop instead).
        listener = socket.socket(socket.AF_INET6 if ":" in spec.host else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((spec.host, port))
        self._serving = asyncio.get_running_loop().create_task(self.server.serve(sockets=[listener]))
        while not self.server.started:
            if self._serving.done():
                raise RuntimeError(f"gateway {index} could not serve on {self.url}")
            await asyncio.sleep(0.02)
        await self.peers.directory.join.remote(index, self.url)
        if self.trajectory_queue:
            self._sweep = asyncio.get_running_loop().create_task(self._hand_off_finished())

    async def handle(self, request: HttpRequest, request_id: str = "") -> AsyncIterator[ResponseStart | bytes]:
        """A request for a session this gateway owns, handed over by another process."""
        gone = self._forwarded.setdefault(request_id, asyncio.Event()) if request_id else None
        parts = self.routing.local(request, gone)
        try:
            async for part in parts:
                yield part
        finally:
            await parts.aclose()  # type: ignore[attr-defined]
            if request_id:
                self._forwarded.pop(request_id, None)

    async def disconnect(self, request_id: str) -> None:
        """The client of a request handed over by another gateway left. An async actor may start
        this before `handle` (no order between them): the request is then born gone, and the mark is
        dropped after a minute if `handle` never comes (it already finished)."""
        if (gone := self._forwarded.get(request_id)) is None:
            gone = self._forwarded[request_id] = asyncio.Event()
            asyncio.get_running_loop().call_later(60, self._forget_unclaimed, request_id, gone)
        gone.set()

    def _forget_unclaimed(self, request_id: str, gone: asyncio.Event) -> None:
        if self._forwarded.get(request_id) is gone:  # a running `handle` keeps its own reference
            del self._forwarded[request_id]

    async def hold_for_update(self, in_flight: InFlight) -> None:
        """A cluster-wide weight update: hold new generations, stop the running ones (at a token
        boundary, or for good under abort) and wait until none is in an engine."""
        gate = self.gateway.gate
        gate.hold()
        self._cluster_hold(True)  # until the registry releases it: resume is refused meanwhile
        if in_flight == "abort":
            gate.abort()
        else:
            gate.seam(in_flight)
        await gate.quiet()

    async def finish_update(self, version: int | None) -> None:
        """Every engine took the weights of `version` (None: the update failed; the version stays):
        generate again."""
        if version is not None:
            self.gateway.gate.version = version
            self.gateway.gate.label = str(version)
        self._cluster_hold(False)
        self.gateway.gate.release()

    def _cluster_hold(self, held: bool) -> None:
        updates: Any = self.gateway.updates
        if isinstance(updates, ClusterUpdates):
            updates.held = held

    async def holds(self, session_id: str) -> bool:
        return await self.gateway.sessions.exists(session_id)

    async def describe(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "url": self.url,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "shard": self.spec.store,
            "sessions_in_memory": (stats := self.gateway.stats()).sessions_in_memory,
            "requests_active": stats.requests_active,
            "engine_calls": stats.engine_calls,
            "weights_version": stats.weights_version,
            "paused": stats.paused,
        }

    async def _export(self, session_id: str) -> dict[str, Any] | None:
        request = HttpRequest("GET", f"/sessions/{session_id}/export", headers=self._own)
        start, body = await collect(self.routing.local(request))
        if start.status != 200:
            return None
        import orjson

        exported: dict[str, Any] = orjson.loads(body)
        return exported

    async def _hand_off(self, session_id: str) -> None:
        assert self.trajectory_queue is not None
        exported = await self._export(session_id)
        if exported is not None:
            queue = ray.get_actor(queue_name(self.trajectory_queue), namespace=NAMESPACE)
            await queue.put.remote(session_id, exported)  # waits while the queue is full: back-pressure

    async def _hand_off_finished(self) -> None:
        """After a restart: finished sessions of this shard the queue has not taken yet."""
        import orjson

        request = HttpRequest("GET", "/export", b"finished=true&output=jsonl", self._own)
        start, body = await collect(self.routing.local(request))
        if start.status != 200:
            return
        queue = ray.get_actor(queue_name(self.trajectory_queue or ""), namespace=NAMESPACE)
        ids = [orjson.loads(line)["session_id"] for line in body.splitlines() if line.strip()]
        missing = await queue.missing.remote(sorted(set(ids)))
        for session_id in missing:
            with contextlib.suppress(Exception):
                await self._hand_off(session_id)


class ClusterUpdates(WeightUpdater):
    """`POST /admin/weights` on a gateway of a cluster whose engines are actors: the engine registry
    runs the update over every engine actor and every gateway (`ray.engines.EngineRegistry`)."""

    def __init__(
        self,
        gate: VersionGate,
        engines: Callable[[], Sequence[Engine]],
        probe_prompt: Sequence[int],
        *,
        registry: Any,
        engine_actors: int,
    ) -> None:
        super().__init__(gate, engines, probe_prompt)
        self.registry = registry
        self.engine_actors = engine_actors
        self.held = False  # held by the registry's update (or its failure) over the whole cluster

    async def _gateways(self) -> list[str]:
        directory = ray.get_actor(DIRECTORY, namespace=NAMESPACE)
        return [gateway_name(i) for i in await directory.gateways.remote()]

    async def update(self, update: WeightUpdate) -> dict[str, Any]:
        from tokentape.ray.engines import engine_actor_name

        engines = [engine_actor_name(i) for i in range(self.engine_actors)]
        self.running = True
        try:
            call = self.registry.update_weights.remote(
                update.version, update.source, update.in_flight, await self._gateways(), engines
            )
            report: dict[str, Any] = await call
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause if isinstance(exc.cause, TokentapeError) else exc from None
        finally:
            self.running = False
        self.last = report
        return report

    def check_resumable(self) -> None:
        """A gateway held by a cluster update is released by the registry alone: resuming it by hand
        would serve on engine actors that are loading, or that a failed update left on other weights."""
        if self.held:
            raise Conflict(
                "a weight update over the cluster holds this gateway: it resumes when the update is done, "
                "or after a failed one with POST /admin/rollback",
                code="update_in_progress",
            )

    async def rollback(self) -> dict[str, Any]:
        await self.registry.resume_after_failure.remote(await self._gateways())
        return {"version": self.gate.version}


class SharedEngineUpdates(WeightUpdater):
    """`POST /admin/weights` on a gateway of a cluster over remote engines: every gateway sends to the
    same engines, and an update run by one gateway would leave the others serving, and labelling
    tokens with the old version, while the engines load. Refused before anything changes; update the
    engines through a gateway of their own (no --ray), or run the cluster on engine actors."""

    async def update(self, update: WeightUpdate) -> dict[str, Any]:
        raise Conflict(
            "weight updates over remote engines shared by the gateways of a Ray cluster are not supported: "
            "the other gateways would go on serving while the engines load; use engine actors "
            "(serve --ray without --engine) or one gateway without --ray",
            param="version",
            code="update_unsupported",
        )


class TrajectoryQueue:
    """Finished sessions for a trainer in the same cluster, in the order they finished. Bounded: a
    full queue makes the gateway wait (back-pressure), it never drops. Each session is handed over
    once; a session offered again (a gateway's sweep after its restart) is ignored."""

    def __init__(self, capacity: int) -> None:
        self.items: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue(maxsize=capacity)
        self.offered: set[str] = set()
        self.taken = 0

    async def put(self, session_id: str, exported: dict[str, Any]) -> bool:
        if session_id in self.offered:
            return False
        self.offered.add(session_id)
        await self.items.put((session_id, exported))
        return True

    async def missing(self, session_ids: list[str]) -> list[str]:
        return [s for s in session_ids if s not in self.offered]

    async def get(self, max_items: int = 1, timeout: float | None = None) -> list[dict[str, Any]]:
        """Up to `max_items` finished sessions (their export); waits up to `timeout` for the first."""
        batch: list[dict[str, Any]] = []
        try:
            _, first = await asyncio.wait_for(self.items.get(), timeout)
        except TimeoutError:
            return batch
        batch.append(first)
        while len(batch) < max_items and not self.items.empty():
            batch.append(self.items.get_nowait()[1])
        self.taken += len(batch)
        return batch

    async def size(self) -> dict[str, int]:
        return {"waiting": self.items.qsize(), "capacity": self.items.maxsize, "taken": self.taken}


# The actor classes. The directory and the queue are restarted with their calls retried; a
# gateway's calls are not retried (a half-done generation must not run twice): the caller sees an
# error and the agent's own retry is answered from the tape.
SessionDirectoryActor: Any = ray.remote(max_restarts=-1, max_task_retries=-1)(SessionDirectory)
GatewayActorClass: Any = ray.remote(max_restarts=-1, max_task_retries=0)(GatewayActor)
TrajectoryQueueActor: Any = ray.remote(max_restarts=-1, max_task_retries=-1)(TrajectoryQueue)

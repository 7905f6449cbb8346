"""Starting a cluster of gateways on Ray, and what a trainer in the same cluster calls.

    cluster = start_cluster(ServeSpec(ray=RayOptions(gateways=2, trajectory_queue="train")))
    ... agents talk to cluster.gateway_urls (or to a front, `tokentape serve --ray`) ...
    batch = trajectories("train").get(max_items=8, timeout=60)   # finished sessions, exported

Every actor is named in the `tokentape` namespace, so any driver connected to the same Ray
cluster finds them; the cluster lives as long as the driver that started it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokentape.ray.actors import (
    DIRECTORY,
    NAMESPACE,
    GatewayActorClass,
    RayPeers,
    SessionDirectoryActor,
    TrajectoryQueueActor,
    gateway_name,
    queue_name,
)
from tokentape.ray.engines import ENGINE_REGISTRY, EmbeddedEngineActor, EngineRegistryActor, engine_actor_name
from tokentape.ray.routing import OwnerRouting
from tokentape.served import RayOptions, ServeSpec
from tokentape.server.middleware import DEFAULT_MAX_BODY_BYTES

__all__ = [
    "Cluster",
    "cluster_status",
    "connect",
    "start_cluster",
    "front_app",
    "serve_cluster",
    "trajectories",
    "TrajectoryReader",
]


def connect(address: str = "local", *, num_cpus: int | None = None) -> None:
    """Join (or with "local", start) a Ray cluster. A local cluster stays on loopback."""
    if ray.is_initialized():
        return
    options: dict[str, Any] = {"namespace": NAMESPACE, "include_dashboard": False, "logging_level": "warning"}
    if address == "local":
        options.update(address="local", _node_ip_address="127.0.0.1", num_cpus=num_cpus)
    else:
        options["address"] = address
    ray.init(**options)


@dataclass(slots=True)
class Cluster:
    spec: ServeSpec  # its `ray` options given
    directory: Any
    gateways: list[Any]
    queue: Any | None
    registry: Any
    engines: list[Any]

    @property
    def options(self) -> RayOptions:
        return self.spec.ray or RayOptions()

    @property
    def gateway_urls(self) -> dict[int, str]:
        return dict(sorted(ray.get(self.directory.gateways.remote()).items()))

    def describe(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Each gateway's state; a gateway that is restarting is waited for."""
        return [_when_up(lambda g=gateway: g.describe.remote(), timeout) for gateway in self.gateways]

    def update_weights(
        self, version: int, *, lora: str | None = None, model: str | None = None, in_flight: str = "continue"
    ) -> dict[str, Any]:
        """Load new weights on every engine actor and switch every gateway to `version` together."""
        from tokentape.gateway.updates import parse_update
        from tokentape.ray.engines import engine_actor_name

        update = parse_update({"version": version, "lora": lora, "model": model, "in_flight": in_flight})
        gateways = [gateway_name(i) for i in sorted(self.gateway_urls)]
        engines = [engine_actor_name(i) for i in range(len(self.engines))]
        report: dict[str, Any] = ray.get(
            self.registry.update_weights.remote(version, update.source, update.in_flight, gateways, engines)
        )
        return report

    def stop(self, timeout: float = 30.0) -> None:
        """Kill every actor of the cluster and wait until their names are free again."""
        queue = [self.queue] if self.queue is not None else []
        for actor in [*self.gateways, *self.engines, self.directory, self.registry, *queue]:
            ray.kill(actor, no_restart=True)
        names = [DIRECTORY, ENGINE_REGISTRY, *(gateway_name(i) for i in range(len(self.gateways)))]
        names += [engine_actor_name(i) for i in range(len(self.engines))]
        queue_named = self.options.trajectory_queue
        names += [queue_name(queue_named)] if queue_named else []
        deadline = time.monotonic() + timeout
        for name in names:
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(name, namespace=NAMESPACE)
                except ValueError:
                    break
                time.sleep(0.05)


def _when_up(call: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(call())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def start_cluster(spec: ServeSpec) -> Cluster:
    """The directory, the queue (if named) and the gateway actors `spec.ray` asks for (default
    `RayOptions()`), spread over the cluster's nodes and pinned there (a gateway restarts beside its
    shard). Gateway i serves on `spec.port + 1 + i`; each is given `spec` with its shard as its store."""
    options = spec.ray or RayOptions()
    spec = dataclasses.replace(spec, ray=options)
    directory = SessionDirectoryActor.options(
        name=DIRECTORY, namespace=NAMESPACE, num_cpus=0, get_if_exists=True
    ).remote()
    queue = None
    if options.trajectory_queue:
        queue = TrajectoryQueueActor.options(
            name=queue_name(options.trajectory_queue), namespace=NAMESPACE, num_cpus=0, get_if_exists=True
        ).remote(options.queue_capacity)
    nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])  # type: ignore[no-untyped-call]
    registry = EngineRegistryActor.options(
        name=ENGINE_REGISTRY, namespace=NAMESPACE, num_cpus=0, get_if_exists=True
    ).remote()
    engine_actors = [] if spec.engines else list(range(options.engine_actors))
    engines = [
        EmbeddedEngineActor.options(
            name=engine_actor_name(index),
            namespace=NAMESPACE,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=False),
        ).remote(spec)
        for index in engine_actors
    ]
    ray.get([engine.info.remote() for engine in engines])
    gateways = []
    for index in range(options.gateways):
        shard = str(Path(options.store_dir).absolute() / f"gateway-{index}.sqlite3")
        gateways.append(
            GatewayActorClass.options(
                name=gateway_name(index),
                namespace=NAMESPACE,
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=False),
            ).remote(dataclasses.replace(spec, store=shard), index)
        )
    ray.get([g.describe.remote() for g in gateways])  # every gateway serving and joined
    return Cluster(spec, directory, gateways, queue, registry, engines)


def front_app(max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> OwnerRouting:
    """The HTTP API of a process that owns no session: every request goes to its owner."""
    return OwnerRouting(None, RayPeers(None), max_body_bytes=max_body_bytes)


class TrajectoryReader:
    """A trainer's end of a trajectory queue."""

    def __init__(self, name: str = "default") -> None:
        self.queue = ray.get_actor(queue_name(name), namespace=NAMESPACE)

    def get(self, max_items: int = 1, timeout: float | None = None) -> list[dict[str, Any]]:
        """Up to `max_items` finished sessions, each as its export; [] if none came within `timeout`."""
        batch: list[dict[str, Any]] = ray.get(self.queue.get.remote(max_items, timeout))
        return batch

    def size(self) -> dict[str, int]:
        return dict(ray.get(self.queue.size.remote()))


def trajectories(name: str = "default") -> TrajectoryReader:
    return TrajectoryReader(name)


def cluster_status() -> dict[str, Any]:
    """Gateways, engines and trajectory queues of the cluster this process is connected to."""
    from tokentape.ray.actors import queue_name

    directory = ray.get_actor(DIRECTORY, namespace=NAMESPACE)
    urls: dict[int, str] = dict(ray.get(directory.gateways.remote()))
    load: dict[int, int] = dict(ray.get(directory.load.remote()))
    gateways = ray.get([ray.get_actor(gateway_name(i), namespace=NAMESPACE).describe.remote() for i in sorted(urls)])
    for described in gateways:
        described["open_sessions"] = load.get(described["index"], 0)
    registry = ray.get_actor(ENGINE_REGISTRY, namespace=NAMESPACE)
    engines: dict[str, Any] = ray.get(registry.describe.remote())
    prefix = queue_name("")
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    queues = {
        name.removeprefix(prefix): ray.get(ray.get_actor(name, namespace=NAMESPACE).size.remote())
        for name in named
        if name.startswith(prefix)
    }
    return {"gateways": gateways, "engines": engines, "queues": queues}


def serve_cluster(spec: ServeSpec) -> None:
    """`tokentape serve --ray`: start the cluster `spec` describes, serve the front API on its port
    until stopped."""
    import uvicorn

    connect((spec.ray or RayOptions()).address)
    cluster = start_cluster(spec)
    urls = ", ".join(cluster.gateway_urls.values())
    print(
        f"tokentape: {cluster.options.gateways} gateways on Ray ({urls}); front at http://{spec.host}:{spec.port}",
        flush=True,
    )
    try:
        uvicorn.run(front_app(spec.max_body_bytes), host=spec.host, port=spec.port, **spec.uvicorn_options())
    finally:
        cluster.stop()

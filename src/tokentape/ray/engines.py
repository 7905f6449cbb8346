"""Engines shared by every gateway of a cluster.

One registry actor keeps the cluster-wide count of requests in flight on each engine and the
engine each session last used; every gateway's router asks it where a generation goes, so a new
session lands on the least-loaded engine cluster-wide and a session's later turns find their
prefix cache. Engines are HTTP servers (vLLM, SGLang: each gateway talks to them directly) or
Ray actors running the embedded llama.cpp engine on CPU nodes (tokens stream back through Ray).

Weight updates across the cluster are the registry's too (`update_weights`): it validates on every
engine actor, holds every gateway (each stops its running generations at a token boundary and waits
until none is in an engine), pauses, loads, probes and resumes every engine actor, and only then
switches every gateway to the new version together. On a failure the engines that loaded are put back
and every gateway stays held, the version unchanged, until `resume_after_failure`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import Any

import ray

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken
from tokentape.engines.remote import RemoteEngine
from tokentape.engines.router import Router
from tokentape.engines.weights import InFlight, WeightSource, WeightUpdateFailed, WeightUpdateRefused
from tokentape.errors import Conflict, EngineFailure, InvalidRequest
from tokentape.ray.placement import EngineBook
from tokentape.served import ServeSpec

__all__ = [
    "ENGINE_REGISTRY",
    "ActorEngine",
    "EmbeddedEngineActor",
    "EngineRegistry",
    "EngineRegistryActor",
    "SharedRouter",
    "engine_actor_name",
]

ENGINE_REGISTRY = "tokentape-engines"


def engine_actor_name(index: int) -> str:
    return f"tokentape-engine-{index}"


class EngineRegistry:
    def __init__(self) -> None:
        self.book = EngineBook()
        self.version = 0
        self.engine_versions: dict[str, int] = {}
        self.updating = False
        self.held_after_failure = False
        self.last_update: dict[str, Any] | None = None

    async def acquire(self, session_id: str | None, usable: list[str]) -> str:
        return self.book.acquire(session_id, usable)

    async def release(self, name: str) -> None:
        self.book.release(name)

    async def describe(self) -> dict[str, Any]:
        return {
            "in_flight": dict(self.book.in_flight),
            "moves": self.book.moves,
            "sessions": dict(self.book.sessions),
            "weights_version": self.version,
            "engine_versions": dict(self.engine_versions),  # the version each engine actor holds
            "updating": self.updating,
            "last_update": self.last_update,
        }

    # -- weight updates across the cluster ---------------------------------------------------------------
    async def update_weights(
        self, version: int, source: WeightSource, in_flight: InFlight, gateways: list[str], engines: list[str]
    ) -> dict[str, Any]:
        """One update over every engine actor and every gateway, atomically (see the module's note)."""
        if self.updating:
            raise Conflict("a weight update is already running", param="version", code="update_in_progress")
        if version <= self.version:
            raise Conflict(
                f"version {version} is not new: the cluster is at version {self.version}",
                param="version",
                code="version_not_new",
            )
        self.updating = True
        try:
            return await self._update(version, source, in_flight, gateways, engines)
        finally:
            self.updating = False

    async def _update(
        self, version: int, source: WeightSource, in_flight: InFlight, gateways: list[str], engines: list[str]
    ) -> dict[str, Any]:
        gateway_actors = [ray.get_actor(name, namespace=_NAMESPACE) for name in gateways]
        engine_actors = [ray.get_actor(name, namespace=_NAMESPACE) for name in engines]
        phases: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            phases[name] = round(now - clock, 6)
            clock = now

        refusals = await _each(engines, [a.check_weights.remote(source, in_flight) for a in engine_actors])
        if refusals:
            raise InvalidRequest("the update is refused: " + "; ".join(refusals), param=source.kind)
        lap("check")
        started = time.perf_counter()
        await asyncio.gather(*(g.hold_for_update.remote(in_flight) for g in gateway_actors))
        lap("hold")
        previous = self.version
        failures = await _each(engines, [a.pause_generation.remote(in_flight) for a in engine_actors])
        lap("pause")
        loaded: list[int] = []
        if not failures:
            results = await asyncio.gather(
                *(a.load_weights.remote(source, version) for a in engine_actors), return_exceptions=True
            )
            for index, result in enumerate(results):
                if isinstance(result, BaseException):
                    failures.append(f"{engines[index]}: {_cause(result)}")
                else:
                    loaded.append(index)
                    self.engine_versions[engines[index]] = version
            lap("load")
        if not failures:
            failures = await _each(engines, [a.probe.remote() for a in engine_actors])
            lap("probe")
        if failures:
            message = f"the update to version {version} failed on " + "; ".join(failures)
            if loaded:  # back to the current weights where the new ones went in
                back = await _each(
                    [engines[i] for i in loaded], [engine_actors[i].restore.remote(previous) for i in loaded]
                )
                for i in loaded:
                    self.engine_versions[engines[i]] = previous
                message += "; putting the old weights back failed too: " + "; ".join(back) if back else ""
            self.held_after_failure = True
            raise EngineFailure(message + f". Every gateway stays held on version {previous}")
        await asyncio.gather(*(a.resume_generation.remote(in_flight != "keep") for a in engine_actors))
        await asyncio.gather(*(g.finish_update.remote(version) for g in gateway_actors))
        self.version = version
        lap("resume")
        self.last_update = {
            "version": version,
            "previous_version": previous,
            "in_flight": in_flight,
            "engines": {name: version for name in engines},
            "gateways": gateways,
            "phases": phases,
            "paused_seconds": round(time.perf_counter() - started, 6),
        }
        return self.last_update

    async def resume_after_failure(self, gateways: list[str]) -> None:
        """Release every gateway held by a failed update, on the version they had."""
        await asyncio.gather(
            *(ray.get_actor(name, namespace=_NAMESPACE).finish_update.remote(None) for name in gateways)
        )
        self.held_after_failure = False


class EmbeddedEngine:
    """The embedded llama.cpp engine as an actor: token IDs in, sampled tokens streamed out."""

    def __init__(self, spec: ServeSpec) -> None:
        from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
        from tokentape.runtime import embedded_model_path

        self.engine = LlamaCppEngine(
            LlamaCppSettings(
                model_path=spec.model or embedded_model_path(),
                context_length=spec.context_length,
                threads=spec.threads,
                parallel=spec.parallel,
                flash_attention=spec.flash,
            )
        )
        self.sources: dict[int, WeightSource] = {}  # what each version loaded, for a restore

    async def info(self) -> dict[str, Any]:
        return {
            "model_id": self.engine.model_id,
            "context_length": self.engine.context_length,
            "weights_version": self.engine.weights_version,
        }

    # the weight-update seam, called by the registry
    async def check_weights(self, source: WeightSource, in_flight: InFlight) -> None:
        await self.engine.check_weights(source, in_flight)

    async def pause_generation(self, in_flight: InFlight) -> None:
        await self.engine.pause_generation(in_flight)

    async def load_weights(self, source: WeightSource, version: int) -> None:
        await self.engine.load_weights(source, version)
        self.sources[version] = source

    async def restore(self, version: int) -> None:
        """The weights of `version` again (those it started with for 0)."""
        await self.engine.load_weights(self.sources.get(version, self.engine.start_source), version)

    async def probe(self) -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        tokens = [t async for t in self.engine.generate([1], params, seed=0)]
        if len(tokens) != 1 or not math.isfinite(tokens[0].logprob):
            raise WeightUpdateFailed(f"the probe prompt gave {tokens!r}")

    async def resume_generation(self, fresh_kv: bool) -> None:
        await self.engine.resume_generation(fresh_kv=fresh_kv)

    async def generate(
        self, prompt: list[int], params: SamplingParams, seed: int | None, session_id: str | None
    ) -> AsyncIterator[SampledToken]:
        stream = self.engine.generate(prompt, params, seed=seed, session_id=session_id)
        try:
            async for token in stream:
                yield token
        finally:
            await stream.aclose()  # cancelled by the gateway: the generation stops here


class ActorEngine(RemoteEngine):
    """An engine actor seen by a gateway's router like any remote engine."""

    def __init__(self, name: str) -> None:
        super().__init__(f"ray://{name}")
        self.name = name
        self.actor = ray.get_actor(name, namespace="tokentape")

    async def discover(self) -> None:
        info = await self.actor.info.remote()
        self.model_id, self.context_length = info["model_id"], int(info["context_length"])

    async def check_health(self) -> bool:
        try:
            await self.actor.info.remote()
            self.healthy = True
        except ray.exceptions.RayError:
            self.healthy = False
        return self.healthy

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
    ) -> AsyncGenerator[SampledToken, None]:
        self._check_constraint(constraint)  # engine actors take no constraint yet: a clear 400
        stream: Any = self.actor.generate.remote(list(prompt), params, seed, session_id)
        done = False
        try:
            async for ref in stream:
                token: SampledToken = await ref
                self.tokens_generated += 1
                yield token
            done = True
        except ray.exceptions.RayError as exc:
            raise EngineFailure(f"engine actor {self.name} failed: {exc}") from exc
        finally:
            if not done:
                ray.cancel(stream)


_NAMESPACE = "tokentape"  # ray.actors.NAMESPACE (not imported: actors imports this module)


async def _each(names: Sequence[str], calls: Sequence[Awaitable[Any]]) -> list[str]:
    """Await every call; "name: why" for each that failed."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    return [f"{name}: {_cause(r)}" for name, r in zip(names, results, strict=True) if isinstance(r, BaseException)]


def _cause(error: BaseException) -> str:
    """The engine's own words, out of Ray's wrapping."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, (WeightUpdateRefused, WeightUpdateFailed, Exception)):
        return str(cause)
    return str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__


class SharedRouter(Router):
    """A gateway's router whose placement is the cluster's: it asks the registry, among the engines
    it sees as usable, and tells it when a generation is over."""

    def __init__(self, engines: Sequence[RemoteEngine], registry: Any, **options: Any) -> None:
        super().__init__(engines, **options)
        self.registry = registry

    async def acquire(self, session_id: str | None) -> RemoteEngine:
        usable = [engine.base_url for engine in self.engines if self._usable(engine)]
        if not usable:
            raise EngineFailure("no healthy engine is available")
        return self.find(await self.registry.acquire.remote(session_id, usable))

    async def release(self, engine: RemoteEngine) -> None:
        await self.registry.release.remote(engine.base_url)


EngineRegistryActor: Any = ray.remote(max_restarts=-1, max_task_retries=-1)(EngineRegistry)
EmbeddedEngineActor: Any = ray.remote(max_restarts=-1, max_task_retries=0)(EmbeddedEngine)

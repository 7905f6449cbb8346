"""Engines shared by every gateway of a cluster.

One registry actor keeps the cluster-wide count of requests in flight on each engine and the
engine each session last used; every gateway's router asks it where a generation goes, so a new
session lands on the least-loaded engine cluster-wide and a session's later turns find their
prefix cache. Engines are HTTP servers (vLLM, SGLang: each gateway talks to them directly) or
Ray actors running the embedded llama.cpp engine on CPU nodes (tokens stream back through Ray).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import ray

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken
from tokentape.engines.remote import RemoteEngine
from tokentape.engines.router import Router
from tokentape.errors import EngineFailure
from tokentape.ray.placement import EngineBook
from tokentape.runtime import RuntimeSettings

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

    async def acquire(self, session_id: str | None, usable: list[str]) -> str:
        return self.book.acquire(session_id, usable)

    async def release(self, name: str) -> None:
        self.book.release(name)

    async def describe(self) -> dict[str, Any]:
        return {
            "in_flight": dict(self.book.in_flight),
            "moves": self.book.moves,
            "sessions": dict(self.book.sessions),
        }


class EmbeddedEngine:
    """The embedded llama.cpp engine as an actor: token IDs in, sampled tokens streamed out."""

    def __init__(self, runtime: RuntimeSettings) -> None:
        from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
        from tokentape.runtime import embedded_model_path

        path = runtime.model_path or embedded_model_path()
        self.engine = LlamaCppEngine(
            LlamaCppSettings(model_path=path, context_length=runtime.context_length, threads=runtime.threads)
        )

    async def info(self) -> dict[str, Any]:
        return {"model_id": self.engine.model_id, "context_length": self.engine.context_length}

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

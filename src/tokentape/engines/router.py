"""Several remote engines behind one Engine: session-affine, least-loaded, health-checked.

A new session goes to the healthy engine with the fewest requests in flight; its later turns stick
to that engine, whose prefix cache holds its history. An engine that fails is taken out of
rotation (its sessions move on their next turn: the tape is intact, only the cache is lost) and is
put back when its health check answers again. Only the engine's own failures count: a transport
error or a 5xx before the first token, never a request the engine refused or answered malformed.
With no engine in rotation the health of all is probed at once (at most once a second) before the
request is refused with 503 and a Retry-After. Each engine takes a bounded number of requests at
once; the rest queue for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, PromptImage, SampledToken, takes_images
from tokentape.errors import EngineFailure, EngineUnavailable, InvalidRequest, NotFound

if TYPE_CHECKING:  # the engines' modules (and aiohttp) load with the first remote engine
    from tokentape.engines.remote import RemoteEngine

__all__ = ["Router"]

STICKY_SESSIONS_KEPT = 100_000  # affinity is a hint: losing an old entry only costs a cache miss
REPROBE_INTERVAL = 1.0  # seconds between on-demand health probes when no engine is in rotation


class Router:
    takes_images = True  # handed to the engine it places a generation on, if that one takes them

    def __init__(
        self,
        engines: Sequence[RemoteEngine],
        *,
        max_in_flight: int = 64,
        health_interval: float = 5.0,
        vocab_size: int | None = None,
    ) -> None:
        if not engines:
            raise NotFound("no engines to route to")
        self.engines: list[RemoteEngine] = list(engines)
        self.vocab_size = vocab_size  # token IDs at or beyond it are engine faults
        for engine in self.engines:
            engine.vocab_size = vocab_size
        self.max_in_flight = max_in_flight
        self.health_interval = health_interval
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._sticky: OrderedDict[str, RemoteEngine] = OrderedDict()
        self._health_task: asyncio.Task[None] | None = None
        self._probed_at = 0.0
        self.moves = 0  # sessions that changed engine because theirs was unhealthy or draining

    @property
    def model_id(self) -> str:
        return self.engines[0].model_id

    @property
    def context_length(self) -> int:
        return min(engine.context_length for engine in self.engines)

    @property
    def tokens_generated(self) -> int:
        return sum(engine.tokens_generated for engine in self.engines)

    # -- membership --------------------------------------------------------------------------------
    def add(self, engine: RemoteEngine) -> None:
        if any(e.base_url == engine.base_url for e in self.engines):
            raise NotFound(f"an engine at {engine.base_url} is already routed to")
        engine.vocab_size = self.vocab_size
        self.engines.append(engine)

    def find(self, url: str) -> RemoteEngine:
        for engine in self.engines:
            if engine.base_url == url.rstrip("/"):
                return engine
        raise NotFound(f"no engine at {url}", param="url")

    async def add_member(self, spec: str, admit: Callable[[], None]) -> None:
        """Add the engine `spec` names once it answers its health check, unless `admit()` raises then."""
        from tokentape.engines.remote.kinds import make_engine

        engine = make_engine(spec)
        try:
            await engine.discover()
            await engine.check_health()
            admit()
            self.add(engine)
        except BaseException:  # refused or unreachable: its connection pools go with it
            await engine.close()
            raise

    def drain_member(self, url: str) -> Coroutine[Any, Any, None]:
        """Place no new work on the engine at `url` from now on; the coroutine returned forgets it once
        its requests finish."""
        engine = self.find(url)
        engine.draining = True
        return self.remove_when_drained(engine)

    async def remove_when_drained(self, engine: RemoteEngine) -> None:
        """Stop placing work on `engine`, let its requests finish, then forget it."""
        engine.draining = True
        while engine.in_flight:
            await asyncio.sleep(0.05)
        if engine in self.engines and len(self.engines) > 1:
            self.engines.remove(engine)
            for session, placed in list(self._sticky.items()):
                if placed is engine:
                    del self._sticky[session]
            await engine.close()

    # -- placement ---------------------------------------------------------------------------------
    def _usable(self, engine: RemoteEngine) -> bool:
        return engine.healthy and not engine.draining

    def place(self, session_id: str | None) -> RemoteEngine:
        placed = self._sticky.get(session_id) if session_id else None
        if placed is not None and self._usable(placed):
            self._sticky.move_to_end(session_id)  # type: ignore[arg-type]
            return placed
        candidates = [e for e in self.engines if self._usable(e)]
        if not candidates:
            raise EngineUnavailable("no healthy engine is available; retry shortly", retry_after=self.health_interval)
        chosen = min(candidates, key=lambda e: (e.in_flight, self.engines.index(e)))
        if session_id:
            if placed is not None:
                self.moves += 1
            self._sticky[session_id] = chosen
            while len(self._sticky) > STICKY_SESSIONS_KEPT:
                self._sticky.popitem(last=False)
        return chosen

    def _slot(self, engine: RemoteEngine) -> asyncio.Semaphore:
        return self._slots.setdefault(engine.base_url, asyncio.Semaphore(self.max_in_flight))

    async def acquire(self, session_id: str | None) -> RemoteEngine:
        """The engine for one generation (placement decided here; a shared registry may decide)."""
        return self.place(session_id)

    async def release(self, engine: RemoteEngine) -> None:
        """The generation placed on `engine` is over."""

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
        images: Sequence[PromptImage] = (),
    ) -> AsyncGenerator[SampledToken, None]:
        if not any(self._usable(e) for e in self.engines):
            await self._reprobe()
        engine = await self.acquire(session_id)
        engine.in_flight += 1  # counted while queued too, so placement sees the real load
        try:
            async with self._slot(engine):
                produced = 0
                try:
                    extra: dict[str, Any] = {}
                    if images:  # only engines that take images are given them
                        if not takes_images(engine):
                            raise InvalidRequest(
                                f"the {engine.kind} engine at {engine.base_url} takes no images; serve the model "
                                "behind vLLM's token route (--engine vllm-generate=URL)",
                                param="messages",
                                code="images_not_supported",
                            )
                        extra["images"] = images
                    stream = engine.generate(
                        prompt, params, seed=seed, session_id=session_id, constraint=constraint, whole=whole, **extra
                    )
                    async with contextlib.aclosing(stream):
                        async for token in stream:
                            produced += 1
                            yield token
                except EngineFailure as exc:
                    # it failed outright: out of rotation until its health check passes
                    if not produced and exc.engine_down:
                        engine.healthy = False
                    raise
        finally:
            engine.in_flight -= 1
            await self.release(engine)

    async def _reprobe(self) -> None:
        """Probe every engine now, unless that was done within the last second."""
        now = time.monotonic()
        if now - self._probed_at >= REPROBE_INTERVAL:
            self._probed_at = now
            await self.check_health()

    # -- health ------------------------------------------------------------------------------------
    async def check_health(self) -> None:
        await asyncio.gather(*(engine.check_health() for engine in self.engines))

    async def start(self) -> None:
        """Learn each engine's model and context length, then check health in the background."""
        await asyncio.gather(*(engine.discover() for engine in self.engines))

        async def loop() -> None:
            while True:
                await asyncio.sleep(self.health_interval)
                await self.check_health()

        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(loop())

    def describe(self) -> dict[str, Any]:
        engines = [
            {**engine.describe(), "sessions": sum(1 for e in self._sticky.values() if e is engine)}
            for engine in self.engines
        ]
        return {"kind": "router", "engines": engines, "moves": self.moves, "tokens_generated": self.tokens_generated}

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        for engine in self.engines:
            await engine.close()

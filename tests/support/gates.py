"""Instruments that order events in a test without sleeping: a gate in front of the real engine
(optionally failing a number of generations before their first token), and an ASGI wrapper that says
when the app has been told a client went away."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, Engine, SampledToken
from tokentape.errors import EngineFailure


class GatedEngine:
    """The real engine behind a gate: a generation waits at the gate until the test opens it. The
    first `fail` generations raise an engine error before their first token instead."""

    def __init__(self, inner: Engine, *, fail: int = 0) -> None:
        self.inner = inner
        self.fail = fail
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()  # a generation is waiting at (or went through) the gate
        self.calls = 0
        self.wholes: list[bool] = []  # the `whole` of each generation asked for

    @property
    def model_id(self) -> str:
        return self.inner.model_id

    @property
    def context_length(self) -> int:
        return self.inner.context_length

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
        self.calls += 1
        self.wholes.append(whole)
        self.entered.set()
        await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise EngineFailure("the engine failed before its first token")
        stream = self.inner.generate(
            prompt, params, seed=seed, session_id=session_id, constraint=constraint, whole=whole
        )
        async for token in stream:
            yield token

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "kind": "gated"}

    async def close(self) -> None:
        return None


class NoticesDisconnects:
    """ASGI wrapper: `noticed` is set once the app has been told a client went away, and the app has
    had a few turns of its event loop to act on it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.noticed = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def watched() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            if message["type"] == "http.disconnect":
                asyncio.get_running_loop().create_task(self._settle())
            return message

        await self.app(scope, watched, send)

    async def _settle(self) -> None:
        for _ in range(10):
            await asyncio.sleep(0)
        self.noticed.set()

"""Test instruments for weight updates: a pool of engines that all take every update (the gateway
updates each member), and a stand-in engine that passes the check but refuses the load."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, Engine, SampledToken
from tokentape.engines.weights import InFlight, WeightSource, WeightUpdateFailed


class Pool:
    """Generates on its first member; the gateway updates every member (`engines`)."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines

    @property
    def model_id(self) -> str:
        return str(self.engines[0].model_id)

    @property
    def context_length(self) -> int:
        return int(self.engines[0].context_length)

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
    ) -> AsyncGenerator[SampledToken, None]:
        first: Engine = self.engines[0]
        return first.generate(prompt, params, seed=seed, session_id=session_id, constraint=constraint, whole=whole)

    def describe(self) -> dict[str, Any]:
        return {"kind": "pool", "tokens_generated": 0}

    async def close(self) -> None:
        return None


class RefusingEngine:
    """Accepts every check and pause, fails every load after `loads_ok` successful ones; records the
    steps it was asked for."""

    def __init__(self, *, loads_ok: int = 0) -> None:
        self.model_id = "refusing"
        self.context_length = 1024
        self.loads_ok = loads_ok
        self.steps: list[str] = []
        self.version = 0
        self.start_source = WeightSource("model", "/nonexistent/start.gguf")

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
        self.steps.append("generate")
        yield SampledToken(2, -0.5)

    async def check_weights(self, source: WeightSource, in_flight: InFlight) -> None:
        self.steps.append("check")

    async def pause_generation(self, in_flight: InFlight) -> None:
        self.steps.append("pause")

    async def load_weights(self, source: WeightSource, version: int) -> None:
        self.steps.append(f"load {version}")
        if self.loads_ok <= 0:
            raise WeightUpdateFailed("the stand-in refuses to load weights")
        self.loads_ok -= 1
        self.version = version

    async def resume_generation(self, *, fresh_kv: bool) -> None:
        self.steps.append("resume")

    def describe(self) -> dict[str, Any]:
        return {"kind": "refusing", "tokens_generated": 0}

    async def close(self) -> None:
        return None


class Stepper:
    """An engine in front of a real one that holds its first generation after `hold_after` tokens
    (`reached` is set; the next token waits for `gate`), so that an update lands after exactly that
    many tokens. Updates go to the real engine (`engines`)."""

    def __init__(self, inner: Any, hold_after: int) -> None:
        import asyncio

        self.inner = inner
        self.engines = [inner]
        self.hold_after = hold_after
        self.reached = asyncio.Event()
        self.gate = asyncio.Event()
        self.calls = 0
        self.prompts: list[list[int]] = []

    @property
    def model_id(self) -> str:
        return str(self.inner.model_id)

    @property
    def context_length(self) -> int:
        return int(self.inner.context_length)

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
        self.prompts.append(list(prompt))
        first = self.calls == 1
        count = 0
        stream = self.inner.generate(prompt, params, seed=seed, session_id=session_id, constraint=constraint)
        try:
            async for token in stream:
                if first and count == self.hold_after:
                    self.reached.set()
                    await self.gate.wait()
                count += 1
                yield token
            if first and count == self.hold_after:  # it ended there: held before it says so
                self.reached.set()
                await self.gate.wait()
        finally:
            await stream.aclose()

    def describe(self) -> dict[str, Any]:
        return {"kind": "stepper", "tokens_generated": 0}

    async def close(self) -> None:
        return None

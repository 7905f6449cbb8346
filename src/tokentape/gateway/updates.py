"""One weight update, atomic over every engine of the gateway.

In order: validate (a version that is new, a known in_flight mode, every engine can do it:
`check_weights` reads headers, changes nothing; any refusal is a 400/409 before anything is paused);
hold new generations and stop the running ones at a token boundary (`continue`, `keep`) or end them
(`abort`), and wait until no generation is in an engine; pause every engine its own way; load the
weights on every engine; resume the engines (dropping every cached prefix unless `keep`; the
gateway still holds every generation, so nothing but the probe reaches them) and probe each with a
fixed prompt (a paused vLLM or SGLang would hold the probe too); only if all of that succeeded, bump
the version and release generation. On a failure the version stays, the
error names the engine and why, every engine that had loaded the new weights loads the current ones
again, every engine paused for the update is resumed and probed (a paused vLLM or SGLang would hold
every later request), and generation stays held by the gateway's own gate until `/admin/resume` (refused while some
engine loaded the new weights and another did not) or `/admin/rollback` (the previous weights loaded
again), or a new update. One update at a time: a second one while one runs is refused (409).

Each phase's duration is reported; `paused` is how long new generations were held.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Engine
from tokentape.engines.weights import (
    IN_FLIGHT_MODES,
    InFlight,
    UpdatableEngine,
    WeightSource,
    WeightUpdateFailed,
    WeightUpdateRefused,
)
from tokentape.errors import Conflict, EngineFailure, InvalidRequest
from tokentape.gateway.versions import VersionGate

__all__ = ["PROBE_TEXT", "UpdateFailed", "WeightUpdate", "WeightUpdater", "engine_name", "parse_update"]

QUIET_TIMEOUT = 30.0  # seconds running generations get to stop at a token boundary (a stuck client's stream)
PROBE_TIMEOUT = 60.0  # seconds for the probe's one token (a cold remote engine's first forward included)
MAX_PATH_LENGTH = 4096  # PATH_MAX on Linux
PROBE_TEXT = "Hello"  # one token on most vocabularies: the probe costs one forward pass


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    version: int
    source: WeightSource
    in_flight: InFlight = "continue"


class UpdateFailed(EngineFailure):
    """An engine failed during the update; the version is unchanged and generation stays held."""

    default_code = "weights_update_failed"
    engine_down = False


def parse_update(data: dict[str, Any]) -> WeightUpdate:
    """The body of `POST /admin/weights`; InvalidRequest naming the field that is wrong."""
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidRequest("version must be an integer", param="version")
    given = [key for key in ("lora", "model", "engine_managed") if data.get(key) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest('send exactly one of "lora": PATH, "model": PATH, "engine_managed": true', param="lora")
    kind = given[0]
    if kind == "engine_managed":
        if data["engine_managed"] is not True:
            raise InvalidRequest("engine_managed must be true", param="engine_managed")
        source = WeightSource("engine_managed")
    else:
        path = data[kind]
        if not isinstance(path, str) or not path:
            raise InvalidRequest(f"{kind} must be a path", param=kind)
        if "\0" in path or len(path) > MAX_PATH_LENGTH:
            raise InvalidRequest(
                f"{kind} must be a path (no NUL byte, at most {MAX_PATH_LENGTH} characters)", param=kind
            )
        source = WeightSource("lora" if kind == "lora" else "model", path)
    in_flight = data.get("in_flight", "continue")
    for mode in IN_FLIGHT_MODES:
        if in_flight == mode:
            return WeightUpdate(version, source, mode)
    raise InvalidRequest(f"in_flight must be one of {', '.join(IN_FLIGHT_MODES)}", param="in_flight")


def engine_name(index: int, engine: Engine) -> str:
    url = getattr(engine, "base_url", None)
    return f"engine {index} ({url})" if url else f"engine {index} ({engine.describe().get('kind')} {engine.model_id})"


@dataclass
class _Failure:
    """What a failed update left: which engines hold the new weights (none: nothing to roll back)."""

    version: int
    loaded: list[int] = field(default_factory=list)
    message: str = ""


class WeightUpdater:
    """The updates of one gateway, given only what they touch (the gateway imports this module, never
    the reverse): its version gate, a way to list its engines now (a pool changes), and the probe's
    prompt in its tokens."""

    def __init__(self, gate: VersionGate, engines: Callable[[], Sequence[Engine]], probe_prompt: Sequence[int]) -> None:
        self.gate = gate
        self.list_engines = engines
        self.probe_prompt = list(probe_prompt)
        self.running = False
        self.history: list[WeightSource | None] = [None]  # the source of each applied version (None: start)
        self.failure: _Failure | None = None
        self.last: dict[str, Any] | None = None  # the report of the last update that succeeded

    def _engines(self) -> list[tuple[str, UpdatableEngine]]:
        out: list[tuple[str, UpdatableEngine]] = []
        for index, engine in enumerate(self.list_engines()):
            name = engine_name(index, engine)
            if not isinstance(engine, UpdatableEngine):
                raise InvalidRequest(f"{name} cannot change its weights under a live gateway", param="version")
            out.append((name, engine))
        return out

    def check_resumable(self) -> None:
        if self.running:
            raise Conflict("a weight update is running; it resumes generation itself", code="update_in_progress")
        failure = self.failure
        if failure is not None and failure.loaded:
            raise Conflict(
                f"engines may hold different weights after the failed update to version {failure.version}: "
                "POST /admin/rollback first",
                code="weights_mixed",
            )
        self.failure = None

    async def update(self, update: WeightUpdate) -> dict[str, Any]:
        gate = self.gate
        if self.running:
            raise Conflict("a weight update is already running", param="version", code="update_in_progress")
        if update.version <= gate.version:
            raise Conflict(
                f"version {update.version} is not new: the gateway is at version {gate.version}",
                param="version",
                code="version_not_new",
            )
        # after a failure that left engines on different weights, a new update is the other way out
        # (every engine then loads the same new weights); resume is what stays refused
        self.running = True
        try:
            return await self._run(update)
        finally:
            self.running = False

    async def _run(self, update: WeightUpdate) -> dict[str, Any]:
        gate = self.gate
        phases: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            phases[name] = now - clock
            clock = now

        engines = self._engines()
        results = await asyncio.gather(
            *(engine.check_weights(update.source, update.in_flight) for _, engine in engines), return_exceptions=True
        )
        for (name, _), result in zip(engines, results, strict=True):
            if isinstance(result, WeightUpdateRefused):
                raise InvalidRequest(f"{name} refuses the update: {result}", param=update.source.kind)
            if isinstance(result, BaseException):
                raise result
        lap("check")
        held_at = time.perf_counter()
        # held by an operator's pause (before or during the update) stays held; held by a failed update
        # is released by this one
        gate.hold()
        if update.in_flight == "abort":
            gate.abort()
        else:
            gate.seam(update.in_flight)
        try:
            await asyncio.wait_for(gate.quiet(), QUIET_TIMEOUT)
        except asyncio.CancelledError:  # the caller left: nothing was paused or loaded
            if not gate.operator_hold:
                gate.release()
            raise
        except TimeoutError:
            if not gate.operator_hold:  # nothing was paused or loaded: generations go on under the old version
                gate.release()
            raise UpdateFailed(
                f"running generations did not stop within {QUIET_TIMEOUT:g} s (a client not reading its "
                f"stream); nothing was loaded, the version stays {gate.version}"
            ) from None
        lap("hold")
        previous = gate.version
        loaded: list[int] = []
        pausing: list[int] = []  # engines whose pause succeeded: resumed again whatever fails after it
        resuming = probed = loading = False
        try:
            await self._step(engines, "pause", lambda e: e.pause_generation(update.in_flight), pausing)
            lap("pause")
            loading = True
            await self._step(engines, "load", lambda e: e.load_weights(update.source, update.version), loaded)
            lap("load")
            # engines resume before their probe: a paused vLLM or SGLang holds every request, the probe's
            # too. The gateway's own gate stays held, so nothing else reaches them until the switch.
            resuming = True
            await self._step(engines, "resume", lambda e: e.resume_generation(fresh_kv=update.in_flight != "keep"))
            lap("resume")
            probed = True
            await self._probe(engines)
            lap("probe")
        except BaseException as exc:
            # Every exit, a cancelled caller's included, leaves the engines serving. Cut off mid-step,
            # any engine may have paused or loaded: all are taken back. The clean-up is shielded: a
            # second cancellation cannot stop it halfway (a paused engine holds every request).
            if not isinstance(exc, UpdateFailed):
                everyone = list(range(len(engines)))
                pausing, loaded = everyone, everyone if loading else loaded
            cleanup = asyncio.ensure_future(
                self._after_failure(engines, update, previous, loaded, pausing, resumed=resuming, probed=probed)
            )
            message = await asyncio.shield(cleanup)
            if not isinstance(exc, UpdateFailed):
                raise
            raise UpdateFailed(f"{exc.message}{message}") from exc
        gate.version = update.version
        gate.label = str(update.version)
        self.history.append(update.source)
        self.failure = None
        still_paused = gate.operator_hold
        if not still_paused:
            gate.release()
        phases["resume"] += time.perf_counter() - clock  # the switch and release count with the resume
        paused = time.perf_counter() - held_at
        report = {
            "version": update.version,
            "previous_version": previous,
            "in_flight": update.in_flight,
            "kind": update.source.kind,
            "engines": [{"engine": name, "version": update.version} for name, _ in engines],
            "phases": {name: round(seconds, 6) for name, seconds in phases.items()},
            "paused_seconds": round(paused, 6),
            "still_paused": still_paused,
        }
        self.last = report
        return report

    async def _after_failure(
        self,
        engines: Sequence[tuple[str, UpdatableEngine]],
        update: WeightUpdate,
        previous: int,
        loaded: list[int],
        pausing: list[int],
        *,
        resumed: bool,
        probed: bool,
    ) -> str:
        """After a failure between pause and switch: the engines that took the new weights load the
        current ones again, every engine paused here runs again (and answers a probe), and the failure
        is recorded; what happened, as words to add to the error's message."""
        message = ""
        if loaded:  # atomic: the engines that took the new weights go back to the current ones
            try:
                await self._restore([engines[i] for i in loaded], previous)
                loaded = []
                message += f"; the engines that had loaded version {update.version} are back on {previous}"
            except UpdateFailed as again:
                message += f"; putting the old weights back failed too ({again.message})"
        # a paused vLLM or SGLang holds every request until resumed, and /admin/resume releases only
        # the gateway's gate: every engine paused here runs again (and answers a probe) before this
        # returns. The gate stays held, so nothing but the probe reaches them. Only the probe
        # computes anything under the new weights: before it, no cached prefix needs dropping.
        to_resume = [engines[i] for i in (range(len(engines)) if resumed else pausing)]
        message += await self._unpause(to_resume, fresh_kv=probed)
        self.failure = _Failure(update.version, loaded, message)
        return message

    async def _step(
        self,
        engines: Sequence[tuple[str, UpdatableEngine]],
        phase: str,
        call: Any,
        succeeded: list[int] | None = None,
    ) -> None:
        results = await asyncio.gather(*(call(engine) for _, engine in engines), return_exceptions=True)
        failed = []
        for index, ((name, _), result) in enumerate(zip(engines, results, strict=True)):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                failed.append(f"{name}: {result}")
            elif succeeded is not None:
                succeeded.append(index)
        if failed:
            version = self.gate.version
            raise UpdateFailed(
                f"the update failed at {phase} on " + "; ".join(failed) + f". The version stays {version}; "
                "generation stays held until POST /admin/resume or /admin/rollback"
            )

    async def _unpause(self, engines: Sequence[tuple[str, UpdatableEngine]], *, fresh_kv: bool) -> str:
        """After a failure: resume `engines` and probe them; what went wrong, as words to add to the
        failure's message ("" when all run)."""
        if not engines:
            return ""
        try:
            await self._step(engines, "resume", lambda e: e.resume_generation(fresh_kv=fresh_kv))
            await self._probe(engines)
        except UpdateFailed as exc:
            return f"; resuming the engines failed too ({exc.message})"
        return ""

    async def _probe(self, engines: Sequence[tuple[str, UpdatableEngine]]) -> None:
        prompt = self.probe_prompt
        params = SamplingParams(max_tokens=1, temperature=0.0)

        async def probe(engine: Any) -> None:  # every engine of the gateway is an Engine too
            own = getattr(engine, "probe_weights", None)
            if own is not None:  # the engine's own probe (the embedded one keeps its cached prefix)
                await own()
                return

            async def one_token() -> list[Any]:
                return [t async for t in engine.generate(prompt, params, seed=0)]

            try:  # a paused engine holds the probe: that is a failure to name, not a hang
                tokens = await asyncio.wait_for(one_token(), PROBE_TIMEOUT)
            except TimeoutError:
                raise WeightUpdateFailed(f"the probe got no token within {PROBE_TIMEOUT:g} s (still paused?)") from None
            if len(tokens) != 1 or not math.isfinite(tokens[0].logprob):
                raise WeightUpdateFailed(f"the probe prompt gave {tokens!r}")

        await self._step(engines, "probe", probe)

    async def _restore(self, engines: Sequence[tuple[str, UpdatableEngine]], version: int) -> None:
        """Load the weights of `version` (the current one) again on `engines`."""
        source = self.history[-1]

        async def load(engine: UpdatableEngine) -> None:
            start = getattr(engine, "start_source", None)
            weights = source if source is not None else start
            if not isinstance(weights, WeightSource):
                raise WeightUpdateFailed("the weights it started with are not known")
            await engine.load_weights(weights, version)

        await self._step(engines, "restore", load)

    async def rollback(self) -> dict[str, Any]:
        """After a failed update: load the weights of the current version again on every engine,
        resume and probe them, then release generation."""
        if self.running:
            raise Conflict("a weight update is running", code="update_in_progress")
        if self.failure is None:
            raise Conflict("there is no failed update to roll back", code="nothing_to_roll_back")
        engines = self._engines()
        gate = self.gate
        started = time.perf_counter()
        self.running = True
        try:
            await self._restore(engines, gate.version)
            await self._step(engines, "resume", lambda e: e.resume_generation(fresh_kv=True))
            await self._probe(engines)  # after the resume, as in an update; the gate holds all else
        finally:
            self.running = False
        self.failure = None
        still_paused = gate.operator_hold  # an operator's pause outlives the rollback, as it does an update
        if not still_paused:
            gate.release()
        return {
            "version": gate.version,
            "seconds": round(time.perf_counter() - started, 6),
            "still_paused": still_paused,
        }

"""What the remote adapters share to take new weights (the seam: engines/weights.py): finding out,
without changing anything, whether the engine has the routes an update needs, and running each step
as one control call whose failure is `WeightUpdateFailed` in the engine's own words.

An engine says what it can do in its OpenAPI schema (`/openapi.json`; vLLM and SGLang both serve
FastAPI): a route is there or not (vLLM adds its weight routes only in dev mode or with runtime LoRA
updating switched on), and a route takes a query parameter or a body or not (`/pause?mode=` and
SGLang's `/pause_generation` mode came in later versions). Reading it is exact where a version table
would be a guess; the version the engine reports is named in a refusal so that the reader knows what
to upgrade from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.engines.remote.client import RemoteEngine
from tokentape.engines.weights import InFlight, WeightSource, WeightUpdateFailed, WeightUpdateRefused
from tokentape.errors import TokentapeError

__all__ = ["Need", "UpdatableRemote"]

READ_TIMEOUT = 30.0  # seconds for reading what an engine can do (its schema is built on first request)


@dataclass(frozen=True, slots=True)
class Need:
    """A route an update needs: `route` (POST), the query parameter it must take (`query`) or whether it
    must take a JSON body (`body`), what it is for (`use`) and what gives an engine that route (`how`)."""

    route: str
    use: str
    how: str
    query: str | None = None
    body: bool = False

    def met(self, paths: dict[str, Any]) -> bool:
        operation = (paths.get(self.route) or {}).get("post")
        if not isinstance(operation, dict):
            return False
        if self.query is not None:
            parameters = operation.get("parameters") or []
            return any(
                isinstance(p, dict) and p.get("in") == "query" and p.get("name") == self.query for p in parameters
            )
        return not self.body or "requestBody" in operation

    def describe(self) -> str:
        route = f"{self.route}?{self.query}=" if self.query else self.route + (" with a body" if self.body else "")
        return f"{self.use} needs POST {route} ({self.how})"


class UpdatableRemote(RemoteEngine):
    """A remote engine that takes new weights; each adapter says what each step calls."""

    version_path = "/version"  # where the engine reports its version (a JSON object with `version`)
    cache_route = ""  # drops every cached prefix
    resume_route = ""  # resumes generation
    adapter: str | None = None  # the LoRA adapter generations name, once one is loaded
    weight_version: int | None = None  # the version last loaded by this gateway
    paused: InFlight | None = None  # the in-flight mode of the pause in force, for the load that follows

    async def _engine_facts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the routes of the engine's OpenAPI schema, what its version route reports); reads only."""
        try:
            schema = await self._call("GET", "/openapi.json", timeout=READ_TIMEOUT)
        except TokentapeError as exc:
            raise self._refused(
                f"its routes cannot be read from /openapi.json ({exc.message}); an update needs them listed"
            ) from exc
        paths = schema.get("paths") if isinstance(schema, dict) else None
        try:
            reported = await self._call("GET", self.version_path, timeout=READ_TIMEOUT)
        except TokentapeError:
            reported = None
        return (paths if isinstance(paths, dict) else {}), (reported if isinstance(reported, dict) else {})

    async def _require(self, needs: Sequence[Need], source: WeightSource) -> dict[str, Any]:
        """Refuse (changing nothing) unless the source names what it must and every need is met;
        what the version route reported, for checks of an adapter's own."""
        if source.kind != "engine_managed" and not source.path:
            raise self._refused(f"a {source.kind} update names the path to load (as the engine sees it)")
        paths, reported = await self._engine_facts()
        missing = [need.describe() for need in needs if not need.met(paths)]
        if missing:
            running = f"it runs {reported['version']}" if reported.get("version") else "it reports no version"
            raise self._refused(f"{'; '.join(missing)}; {running}")
        return reported

    def _check_kept_adapter(self, source: WeightSource, in_flight: InFlight, *, swaps_in_place: bool) -> None:
        """Refuse keep where a request held in place by the engine would go on under an adapter other than
        the one its later tokens are labelled with (a new adapter name, the first adapter, new base
        weights under an adapter). Stricter than the gateway needs: it stops every generation before
        the engine pauses and resubmits prompt + sampled tokens naming the current adapter, so no
        request of its own is held in place; keep there only leaves the prefix cache undropped."""
        if in_flight != "keep":
            return
        if source.kind == "lora" and not (swaps_in_place and self.adapter is not None):
            why = "the first adapter" if swaps_in_place else "an adapter"
            raise self._refused(f"{why} cannot be swapped in under requests paused in place; use continue or abort")
        if source.kind == "model" and self.adapter is not None:
            raise self._refused(
                "new base weights drop the adapter that requests paused in place run under; use continue or abort"
            )

    def _refused(self, why: str) -> WeightUpdateRefused:
        return WeightUpdateRefused(f"the {self.kind} engine at {self.base_url} cannot take this update: {why}")

    async def _step(self, what: str, path: str, *, body: object = None, params: dict[str, str] | None = None) -> object:
        """POST one step of an update; a refusal or failure is `WeightUpdateFailed` with the engine's words."""
        try:
            answer = await self._call("POST", path, body=body, params=params)
        except TokentapeError as exc:
            raise WeightUpdateFailed(
                f"the {self.kind} engine at {self.base_url} could not {what}: {exc.message}"
            ) from exc
        if isinstance(answer, dict) and answer.get("success") is False:  # said in a 200, where some routes say it
            words = answer.get("message") or answer.get("error_message") or answer
            raise WeightUpdateFailed(f"the {self.kind} engine at {self.base_url} could not {what}: {words}")
        return answer

    # the seam, each adapter's own way
    async def check_weights(self, source: WeightSource, in_flight: InFlight) -> None:
        raise NotImplementedError

    async def pause_generation(self, in_flight: InFlight) -> None:
        raise NotImplementedError

    async def load_weights(self, source: WeightSource, version: int) -> None:
        raise NotImplementedError

    async def resume_generation(self, *, fresh_kv: bool) -> None:
        if fresh_kv:  # before anything runs again: nothing may reuse a prefix the old weights computed
            await self._step("drop its prefix cache", self.cache_route)
        await self._step("resume", self.resume_route)
        self.paused = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "adapter": self.adapter, "weight_version": self.weight_version}

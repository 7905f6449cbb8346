"""The in-process client: a real `openai.AsyncOpenAI` whose HTTP transport calls the gateway's ASGI
app in the same process (no port, no server). Responses and errors are byte for byte the gateway's,
token fields included (`prompt_token_ids`, `choices[i].token_ids`, `logprobs.content[j].token_id`).

    gateway = InProcessGateway()                      # the embedded model
    await gateway.create_session("episode-1")         # the session, and its own key for the agent
    client = gateway.client(session_id="episode-1")   # an openai.AsyncOpenAI bound to that session and key
    reply = await client.chat.completions.create(model=gateway.model, messages=[...])
    await gateway.finish("episode-1", reward=1.0)
    sample = await gateway.export("episode-1", format="verifiers")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx2
import openai

from tokentape.gateway.service import Gateway
from tokentape.served import Served, ServeSpec, build_served

if TYPE_CHECKING:
    from tokentape.engines.base import Engine
    from tokentape.render.renderer import Renderer
    from tokentape.store.base import TrajectoryStore

__all__ = ["GatewayClient", "InProcessGateway", "BASE"]

BASE = "http://tokentape.local"


class GatewayClient:
    """OpenAI clients and session helpers for one gateway, over one HTTP client.

    `api_key` is a trainer key: this object's own calls (create, reward, finish, export) carry it.
    An agent's client (`client(session_id)`) carries its session's own key, from `create_session`,
    never the trainer key: whatever the agent runs can reach its session's generation routes alone."""

    def __init__(self, http: httpx2.AsyncClient, model: str, api_key: str | None = None) -> None:
        self.http = http
        self.model = model
        self.base = str(http.base_url).rstrip("/")
        # sent per call, never as a default header of `http`, which the agents' clients share
        self._trainer = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._trainer_key = api_key
        self._session_keys: dict[str, str] = {}  # session id -> its key, from create_session

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None) -> GatewayClient:
        """A gateway running elsewhere (`tokentape serve`); `api_key`: one of its trainer keys."""
        http = httpx2.AsyncClient(base_url=url, timeout=None)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        response = await http.get("/v1/models", headers=headers)
        if response.status_code >= 400:
            await http.aclose()
            error = response.json().get("error", {})
            raise openai.APIStatusError(error.get("message", "error"), response=response, body=error)
        return cls(http, response.json()["data"][0]["id"], api_key)

    def session_key(self, session_id: str) -> str | None:
        """The key `create_session` received for this session (what its agent should hold)."""
        return self._session_keys.get(session_id)

    def client(self, session_id: str | None = None, **options: Any) -> openai.AsyncOpenAI:
        """An `openai.AsyncOpenAI` for one session, holding that session's own key: what to hand an
        agent. A session this client did not create has no key here: on a gateway with trainer keys
        that is an error rather than handing the agent the trainer key. Without an id: one new session
        per call, the trainer's own calls, with the trainer key (never an agent's client)."""
        base_url = f"{self.base}/sessions/{session_id}/v1" if session_id else f"{self.base}/v1"
        key = self._session_keys.get(session_id) if session_id else self._trainer_key
        if key is None and self._trainer:
            raise ValueError(
                f"no key for session {session_id!r}: create it with create_session() so its agent gets its own key"
            )
        options.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=base_url, api_key=key or "in-process", http_client=self.http, **options)

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._trainer:
            kwargs["headers"] = {**self._trainer, **kwargs.get("headers", {})}
        response = await self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            error = response.json().get("error", {})
            raise openai.APIStatusError(error.get("message", "error"), response=response, body=error)
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.content

    async def create_session(self, session_id: str, **fields: Any) -> dict[str, Any]:
        """Fields: group_id, metadata, reward, rewrite_policy. The answer carries the session's own
        key (`api_key`) and `base_url`; `client(session_id)` hands them to the agent."""
        result: dict[str, Any] = await self._call("POST", "/sessions", json={"session_id": session_id, **fields})
        if isinstance(key := result.get("api_key"), str):
            self._session_keys[session_id] = key
        return result

    async def reward(self, session_id: str, **rewards: Any) -> dict[str, Any]:
        """Rewards: reward, branch_rewards, turn_rewards."""
        result: dict[str, Any] = await self._call("POST", f"/sessions/{session_id}/reward", json=rewards)
        return result

    async def finish(self, session_id: str, metadata: dict[str, Any] | None = None, **rewards: Any) -> dict[str, Any]:
        """Freeze a session, after setting any rewards given; `metadata` is merged in."""
        if rewards:
            await self.reward(session_id, **rewards)
        body = {"metadata": metadata} if metadata else {}
        result: dict[str, Any] = await self._call("POST", f"/sessions/{session_id}/finish", json=body)
        self._session_keys.pop(session_id, None)  # its key stops working
        return result

    async def detokenize(self, tokens: list[int]) -> str:
        return str((await self._call("POST", "/detokenize", json={"tokens": tokens}))["prompt"])

    async def export(
        self, session_id: str, format: str | None = None, *, max_lag: int | None = None, lag_mode: str | None = None
    ) -> Any:
        """One session's export; `max_lag` (with `lag_mode` drop or mask) as `GET /sessions/{id}/export`."""
        given = {"format": format, "max_lag": max_lag, "lag_mode": lag_mode}
        params = {k: str(v) for k, v in given.items() if v is not None}
        return await self._call("GET", f"/sessions/{session_id}/export", params=params)

    async def export_all(self, format: str = "tokentape", output: str = "json", **filters: Any) -> Any:
        params = {"format": format, "output": output, **{k: str(v) for k, v in filters.items() if v is not None}}
        return await self._call("GET", "/export", params=params)

    async def update_weights(
        self,
        version: int,
        *,
        lora: str | None = None,
        model: str | None = None,
        engine_managed: bool = False,
        in_flight: str = "continue",
    ) -> dict[str, Any]:
        """New weights on every engine of the gateway, atomically (`POST /admin/weights`, with the
        trainer key): the seconds each phase took (`check`, `hold`, `pause`, `load`, `probe`,
        `resume`, `paused_seconds`) and the gateway's status after it. A refused or failed update
        raises `openai.APIStatusError` with the gateway's error (400/409 before anything paused, 502
        naming the engine that failed; the gateway then stays held until `rollback()`)."""
        body: dict[str, Any] = {"version": version, "in_flight": in_flight}
        body.update({k: v for k, v in (("lora", lora), ("model", model)) if v is not None})
        if engine_managed:
            body["engine_managed"] = True
        result: dict[str, Any] = await self._call("POST", "/admin/weights", json=body)
        return result

    async def rollback(self) -> dict[str, Any]:
        """After a failed update: the current version's weights on every engine again, and resume."""
        result: dict[str, Any] = await self._call("POST", "/admin/rollback")
        return result

    async def aclose(self) -> None:
        await self.http.aclose()


class _StartingTransport(httpx2.AsyncBaseTransport):
    """Calls the app in-process, starting the gateway before the first request (as a server's
    lifespan would: remote engines learn their model and start their health checks)."""

    def __init__(self, app: Any, gateway: Gateway) -> None:
        self.inner = httpx2.ASGITransport(app=app)
        self.gateway = gateway

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        await self.gateway.start()
        return await self.inner.handle_async_request(request)


class InProcessGateway(GatewayClient):
    """A gateway and its app in this process: no port, no server. It starts with the first request.

    `InProcessGateway(spec)` builds the gateway `spec` describes (default: the embedded model, a
    `:memory:` store, no keys); `engine`, `renderer` and `store` replace what the spec describes (a
    trainer's own engine). With trainer keys (`spec.api_keys`), this object's own calls carry the first.
    `aclose()` closes the gateway, and the engine with it, unless the engine was given (it stays its
    owner's to close). `InProcessGateway(served=...)` calls a gateway built elsewhere, left to its owner."""

    def __init__(
        self,
        spec: ServeSpec | None = None,
        *,
        engine: Engine | None = None,
        renderer: Renderer | None = None,
        store: TrajectoryStore | None = None,
        served: Served | None = None,
    ) -> None:
        self._owns_gateway = served is None and engine is None
        if served is None:
            served = build_served(spec or ServeSpec(), engine=engine, renderer=renderer, store=store)
        self.served = served
        self.gateway = served.gateway
        self.app = served.app
        model = served.model_id or served.gateway.engine.model_id
        http = httpx2.AsyncClient(transport=_StartingTransport(self.app, self.gateway), base_url=BASE, timeout=None)
        super().__init__(http, model, served.spec.trainer_key)

    async def aclose(self) -> None:
        await super().aclose()
        if self._owns_gateway:
            await self.gateway.aclose()

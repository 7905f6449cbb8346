"""The in-process client: a real `openai.AsyncOpenAI` whose HTTP transport calls the gateway's ASGI
app in the same process (no port, no server). Responses and errors are byte for byte the gateway's,
token fields included (`prompt_token_ids`, `choices[i].token_ids`, `logprobs.content[j].token_id`).

    gateway = InProcessGateway()                      # the embedded model
    client = gateway.client(session_id="episode-1")   # an openai.AsyncOpenAI bound to one session
    reply = await client.chat.completions.create(model=gateway.model, messages=[...])
    await gateway.finish("episode-1", reward=1.0)
    sample = await gateway.export("episode-1", format="verifiers")
"""

from __future__ import annotations

from typing import Any

import httpx2
import openai

from tokentape.gateway.service import Gateway
from tokentape.runtime import RuntimeSettings, build_gateway
from tokentape.server.app import create_app

__all__ = ["GatewayClient", "InProcessGateway", "BASE"]

BASE = "http://tokentape.local"


class GatewayClient:
    """OpenAI clients and session helpers for one gateway, over one HTTP client."""

    def __init__(self, http: httpx2.AsyncClient, model: str) -> None:
        self.http = http
        self.model = model
        self.base = str(http.base_url).rstrip("/")

    @classmethod
    async def connect(cls, url: str) -> GatewayClient:
        """A gateway running elsewhere (`tokentape serve`)."""
        http = httpx2.AsyncClient(base_url=url, timeout=None)
        models = (await http.get("/v1/models")).json()
        return cls(http, models["data"][0]["id"])

    def client(self, session_id: str | None = None, **options: Any) -> openai.AsyncOpenAI:
        """An `openai.AsyncOpenAI` for one session (or, without an id, one new session per call)."""
        base_url = f"{self.base}/sessions/{session_id}/v1" if session_id else f"{self.base}/v1"
        options.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=base_url, api_key="in-process", http_client=self.http, **options)

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            error = response.json().get("error", {})
            raise openai.APIStatusError(error.get("message", "error"), response=response, body=error)
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.content

    async def create_session(self, session_id: str, **fields: Any) -> dict[str, Any]:
        """Fields: group_id, metadata, reward, rewrite_policy."""
        result: dict[str, Any] = await self._call("POST", "/sessions", json={"session_id": session_id, **fields})
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
        return result

    async def export(self, session_id: str, format: str | None = None) -> Any:
        params = {"format": format} if format else {}
        return await self._call("GET", f"/sessions/{session_id}/export", params=params)

    async def export_all(self, format: str = "tokentape", output: str = "json", **filters: Any) -> Any:
        params = {"format": format, "output": output, **{k: str(v) for k, v in filters.items() if v is not None}}
        return await self._call("GET", "/export", params=params)

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
    """A gateway and its app in this process: no port, no server. It starts with the first request;
    `aclose()` closes a gateway it built (a gateway passed in stays its owner's to close)."""

    def __init__(
        self,
        settings: RuntimeSettings | None = None,
        *,
        gateway: Gateway | None = None,
        model: str | None = None,
        match_prefix: bool | None = None,
    ) -> None:
        """`match_prefix`: calls that name no session continue the one live session their history
        extends (as `tokentape serve --match-prefix`); None keeps the setting of `settings`/`gateway`."""
        self._owns_gateway = gateway is None
        if gateway is None:
            gateway, model = build_gateway(settings or RuntimeSettings())
        if match_prefix is not None:
            gateway.sessions.match_prefix = match_prefix
        self.gateway = gateway
        self.app = create_app(gateway, model_id=model or gateway.engine.model_id)
        http = httpx2.AsyncClient(transport=_StartingTransport(self.app, gateway), base_url=BASE, timeout=None)
        super().__init__(http, model or gateway.engine.model_id)

    async def aclose(self) -> None:
        await super().aclose()
        if self._owns_gateway:
            await self.gateway.aclose()

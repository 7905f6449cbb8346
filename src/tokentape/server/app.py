"""The ASGI app. OpenAI routes live under `/v1` and again under `/sessions/{session_id}/v1`, so an
agent that only lets you set `base_url` still lands in its session. A session may also be named by
the `X-Session-ID` header or the `session_id` body field.

Generation routes are dialects of the serving layer (`serving.py`), one per entry of the dialect
registry (`dialects/registry.py`); this module wires them (on the lean path and as FastAPI routes for
the schema), the token utilities, the session and admin routes, and the gateway's start and close."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pydantic
from fastapi import APIRouter, Depends, FastAPI, Path, Request, Response
from starlette.convertors import Convertor, register_url_convertor
from starlette.types import Receive, Scope, Send

from tokentape.core.messages import flatten_text_parts
from tokentape.errors import InvalidRequest
from tokentape.gateway.service import Gateway
from tokentape.metrics import CONTENT_TYPE
from tokentape.render.renderer import RenderOptions
from tokentape.server.admin import add_admin_routes
from tokentape.server.bodies import json_object
from tokentape.server.dialects.anthropic import COUNT_TOKENS_PATH, AnthropicMessages, count_tokens_route
from tokentape.server.dialects.anthropic_input import CountTokensRequest
from tokentape.server.dialects.images import ImageLimits
from tokentape.server.dialects.registry import DIALECTS, shape_for_path
from tokentape.server.errors import handle_error, install_error_handlers, invalid_from_validation
from tokentape.server.heap import settle_for_serving
from tokentape.server.hot_routes import HotRoutes
from tokentape.server.keys import SessionKeys
from tokentape.server.loop_lag import watch_loop_lag
from tokentape.server.middleware import Guard, GuardSettings
from tokentape.server.protocol import DetokenizeRequest, TokenizeRequest
from tokentape.server.serving import DialectContext, Serving
from tokentape.server.sessions_api import add_session_routes
from tokentape.version import VERSION

__all__ = ["GatewayApp", "create_app"]


async def _parse(request: Request, model: type[Any]) -> tuple[Any, dict[str, Any]]:
    data = await json_object(request)
    try:
        return model.model_validate(data), data
    except pydantic.ValidationError as exc:
        raise invalid_from_validation(exc) from exc


class _AnySessionName(Convertor[str]):
    """Matches any text as a base-URL session name, slashes and newlines included, so that every
    bad name reaches the serving layer and is rejected there (400, in its dialect's error shape)
    instead of missing every route."""

    regex = r"[\s\S]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("session", _AnySessionName())


def _session_path(session_id: str = Path(description="The session every call under this base URL belongs to")) -> None:
    """Declares the base-URL session id to the OpenAPI schema; the serving layer reads it itself."""


def _body_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    # a fresh copy for each route: FastAPI merges it into the operation it builds, by reference
    schema = orjson.loads(_json_schema(model))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@functools.cache
def _json_schema(model: type[pydantic.BaseModel]) -> bytes:
    """A request model's JSON schema, built once a process (about 10 ms each, for every app built)."""
    return orjson.dumps(model.model_json_schema(ref_template="#/components/schemas/{model}"))


class GatewayApp(FastAPI):
    """FastAPI, with the generation routes answered on their lean path before its stack runs."""

    lean: HotRoutes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.lean.match(scope) if self.lean is not None else None
        if found is None:
            await super().__call__(scope, receive, send)
        else:
            assert self.lean is not None
            await self.lean.serve(scope, receive, send, *found)


def create_app(
    gateway: Gateway,
    *,
    model_id: str | None,
    guard: GuardSettings | None = None,
    owns_gateway: bool = False,
    serving_process: bool = False,
    image_limits: ImageLimits | None = None,
    prompt_token_ids: str = "always",
) -> FastAPI:
    """The ASGI app. It starts the gateway when it starts; a server that owns the gateway also closes
    it when it shuts down (every pending write finishes, the store checkpoints its log). In a process
    that exists to serve it (`serving_process`), the garbage collector is settled once it has started."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        if serving_process:
            settle_for_serving()
        async with watch_loop_lag(gateway.metrics.loop_lag):
            yield
        if owns_gateway:
            await gateway.aclose()

    app = GatewayApp(
        title="tokentape", summary="Token-exact OpenAI-compatible gateway", version=VERSION, lifespan=lifespan
    )
    install_error_handlers(app, shape_for_path)
    serving = Serving(gateway, model_id)
    tokenizer = serving.tokenizer
    renderer = gateway.renderer
    context = DialectContext(
        tokenizer,
        renderer.tool_format,
        renderer.reasoning,
        gateway.engine.context_length,
        vision=renderer.vision is not None,
        image_limits=image_limits or ImageLimits(),
        image_refusal=renderer.vision.refusal if renderer.vision is not None else None,
        prompt_token_ids=prompt_token_ids,
        held=gateway.sessions.held,
    )
    generation = {dialect.path: (dialect, serving.route(dialect(context))) for dialect in DIALECTS}
    settings = guard or GuardSettings()
    keys = SessionKeys(gateway.sessions, settings.max_in_flight_per_key)
    app.add_middleware(Guard, settings=settings, keys=keys)
    app.lean = HotRoutes(
        {path: handler for path, (_, handler) in generation.items()},
        on_error=handle_error,
        guard=Guard(None, settings, keys),
    )
    # FastAPI keeps the same routes for its schema, and again under a session's base URL
    dialect_routes = APIRouter()
    for path, (dialect, handler) in generation.items():
        schema = _body_schema(dialect.request_model)
        dialect_routes.add_api_route(path, handler, methods=["POST"], openapi_extra=schema)
    counting = count_tokens_route(serving, AnthropicMessages(context))  # records nothing: off the lean path
    count_schema = _body_schema(CountTokensRequest)
    dialect_routes.add_api_route(COUNT_TOKENS_PATH, counting, methods=["POST"], openapi_extra=count_schema)

    # -- OpenAI's other routes ----------------------------------------------------------------------
    openai_routes = APIRouter()

    @openai_routes.get("/models")
    async def models() -> dict[str, Any]:
        """The one model this gateway serves: its name (the `model` every request must send or omit)
        and its context length (`max_model_len`)."""
        return {
            "object": "list",
            "data": [
                {
                    "id": serving.model,
                    "object": "model",
                    "created": int(app.state.started),
                    "owned_by": "tokentape",
                    "max_model_len": gateway.engine.context_length,
                }
            ],
        }

    @openai_routes.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness: `{"status": "ok"}` with the model, sessions in memory, requests running and tokens
        generated. At the root it needs no key (for probes)."""
        stats = gateway.stats()
        return {
            "status": "ok",
            "model": serving.model,
            "sessions_in_memory": stats.sessions_in_memory,
            "requests_active": stats.requests_active,
            "engine_calls": stats.engine_calls,
            "tokens_generated": stats.engine.get("tokens_generated"),
        }

    @openai_routes.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> dict[str, Any]:
        """Token IDs of a `prompt`, or of `messages` rendered by the chat template (vLLM's route):
        `tokens`, `count` and `max_model_len`. Nothing is recorded."""
        req, raw = await _parse(request, TokenizeRequest)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("send either 'prompt' or 'messages'", param="prompt")
        if req.prompt is not None:
            prompt: str = req.prompt
            tokens = await asyncio.to_thread(tokenizer.encode, prompt)  # any length: off the event loop
        else:
            messages = [flatten_text_parts(m) for m in raw["messages"]]
            options = RenderOptions(tools=req.tools, template_kwargs=req.chat_template_kwargs)
            renderer = gateway.renderer
            text = await asyncio.to_thread(renderer.render_text, messages, req.add_generation_prompt, options)
            tokens = await asyncio.to_thread(renderer.encode, text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": gateway.engine.context_length}

    @openai_routes.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        """The text of a list of token IDs (`tokens`), as `prompt` (vLLM's route). Nothing is recorded."""
        req, _ = await _parse(request, DetokenizeRequest)
        serving.check_model(req.model)
        if any(not 0 <= t < tokenizer.vocab_size for t in req.tokens):
            raise InvalidRequest(f"token IDs must be between 0 and {tokenizer.vocab_size - 1}", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    app.include_router(dialect_routes)
    app.include_router(dialect_routes, prefix="/sessions/{session_id:session}", dependencies=[Depends(_session_path)])
    app.include_router(openai_routes, prefix="/v1")
    app.include_router(openai_routes, prefix="/sessions/{session_id:session}/v1", dependencies=[Depends(_session_path)])
    app.add_api_route("/health", health, methods=["GET"])

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Prometheus metrics: sessions, turns, tokens, rewrites, engine and store latency, 429s."""
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    app.add_api_route("/tokenize", tokenize, methods=["POST"], openapi_extra=_body_schema(TokenizeRequest))
    app.add_api_route("/detokenize", detokenize, methods=["POST"], openapi_extra=_body_schema(DetokenizeRequest))

    add_session_routes(app, gateway, keys, forget=serving.reparser.forget)
    add_admin_routes(app, gateway, settings.weights_dirs)
    app.state.started = time.time()
    return app

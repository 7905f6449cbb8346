"""Routes. OpenAI routes live under `/v1` and again under `/sessions/{session_id}/v1`, so an agent
that only lets you set `base_url` still lands in its session. A session may also be named by the
`X-Session-ID` header or the `session_id` body field."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import orjson
import pydantic
from fastapi import APIRouter, Depends, FastAPI, Path, Request
from fastapi.responses import Response, StreamingResponse

from tokentape.core.messages import flatten_text_parts
from tokentape.core.sampling import SamplingParams
from tokentape.engines.router import Router
from tokentape.errors import InvalidRequest, NotFound, TokentapeError
from tokentape.gateway.service import ChatCall, ChoiceDone, CompletionCall, Event, Gateway, Started, TextDelta
from tokentape.gateway.sessions import check_policy, check_session_id
from tokentape.render.renderer import RenderOptions
from tokentape.server.admin import add_admin_routes
from tokentape.server.errors import error_body, install_error_handlers, invalid_from_validation, json_response
from tokentape.server.middleware import Guard, GuardSettings
from tokentape.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from tokentape.server.responses import WireBuilder
from tokentape.server.sessions_api import add_session_routes, json_object

__all__ = ["create_app"]

SESSION_HEADER = "x-session-id"
_Body = TypeVar("_Body", bound=pydantic.BaseModel)
Handler = Callable[[Request], Coroutine[Any, Any, Response]]


async def _parse(request: Request, model: type[_Body]) -> tuple[_Body, dict[str, Any]]:
    data = await json_object(request)
    try:
        return model.model_validate(data), data
    except pydantic.ValidationError as exc:
        raise invalid_from_validation(exc) from exc


def _session_path(session_id: str = Path(description="The session every call under this base URL belongs to")) -> None:
    """Declares the base-URL session id to the OpenAPI schema; the handlers read it themselves."""


def _request_key(request: Request, body: bytes) -> bytes:
    """Names a request by where it went and what it said; an SDK retry repeats both exactly."""
    return hashlib.blake2b(request.url.path.encode() + b"\0" + body, digest_size=16).digest()


def _is_retry(request: Request) -> bool:
    try:
        return int(request.headers.get("x-stainless-retry-count", "0")) > 0
    except ValueError:
        return False


def _session_id(request: Request, body_value: str | None) -> str | None:
    named = {
        value
        for value in (request.path_params.get("session_id"), request.headers.get(SESSION_HEADER), body_value)
        if value
    }
    if len(named) > 1:
        raise InvalidRequest("the request names more than one session", param="session_id")
    return check_session_id(named.pop()) if named else None


def _stop(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


async def _until_done_or_gone(request: Request, events: AsyncIterator[Event]) -> list[ChoiceDone]:
    """Collect a non-streamed response; if the client goes away first, stop generating (the turn is
    recorded as aborted with what was sampled)."""

    async def collect() -> list[ChoiceDone]:
        async with contextlib.aclosing(events) as stream:  # type: ignore[type-var]
            return [event async for event in stream if isinstance(event, ChoiceDone)]

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(collect()), asyncio.create_task(gone())
    finished, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if work not in finished:
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return []
    return work.result()


def _sampling(req: SamplingFields, max_tokens: int | None, *, logprobs: bool, top_logprobs: int) -> SamplingParams:
    """OpenAI's defaults for what the request leaves out; SamplingParams checks the ranges."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=req.top_k or 0,
        min_p=0.0 if req.min_p is None else float(req.min_p),
        seed=req.seed,
        stop=_stop(req.stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=1 if req.n is None else req.n,
    )


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a request: text or token IDs, possibly wrapped in a list of one."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(item, int) for item in prompt):
        return [item for item in prompt if isinstance(item, int)]
    if len(prompt) != 1:
        raise InvalidRequest("send one prompt per request", param="prompt")
    (only,) = prompt
    if isinstance(only, str):
        return only
    if isinstance(only, list):
        return [item for item in only if isinstance(item, int)]
    raise InvalidRequest("the prompt must be text or token IDs", param="prompt")


def _body_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def create_app(
    gateway: Gateway,
    *,
    model_id: str | None,
    guard: GuardSettings | None = None,
    close_store_on_shutdown: bool = False,
) -> FastAPI:
    """The ASGI app. A server that owns the gateway closes its store when it shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if isinstance(gateway.engine, Router):
            await gateway.engine.start()
        yield
        if close_store_on_shutdown:
            gateway.sessions.store.close()  # checkpoint the WAL into the database file

    app = FastAPI(
        title="tokentape", summary="Token-exact OpenAI-compatible gateway", version="0.1.0", lifespan=lifespan
    )
    app.add_middleware(Guard, settings=guard or GuardSettings())
    install_error_handlers(app)
    tokenizer = gateway.renderer.tokenizer

    def _resolve_session(request: Request, body_value: str | None, key: bytes) -> str | None:
        """The named session; for an SDK retry of an unnamed call, the session its first attempt opened."""
        named = _session_id(request, body_value)
        if named is None and _is_retry(request):
            return gateway.sessions.unnamed_session(key)
        return named

    def served() -> str:
        """The model name clients send: fixed, or the engines' own (learnt when they answer)."""
        return model_id or gateway.engine.model_id

    def check_model(name: str | None) -> None:
        if name is not None and name != served():
            raise NotFound(
                f"the model '{name}' does not exist; this server serves '{served()}'",
                param="model",
                code="model_not_found",
            )

    async def sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        except TokentapeError as exc:
            yield b"data: " + orjson.dumps(error_body(exc.message, exc.error_type, exc.param, exc.code)) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def start(events: AsyncIterator[Event]) -> Started:
        first = await anext(events)  # planning errors surface here, before any byte is sent
        assert isinstance(first, Started)
        return first

    # -- OpenAI routes ----------------------------------------------------------------------------
    openai_routes = APIRouter()

    @openai_routes.post("/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        req, raw = await _parse(request, ChatCompletionRequest)
        key = _request_key(request, await request.body())
        check_model(req.model)
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            raise InvalidRequest("max_completion_tokens must be at least 1", param="max_completion_tokens")
        top = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sampling = _sampling(req, max_tokens, logprobs=bool(req.logprobs) or top > 0, top_logprobs=top)
        call = ChatCall(
            messages=[flatten_text_parts(m) for m in raw["messages"]],
            sampling=sampling,
            options=RenderOptions(tools=req.tools, template_kwargs=req.chat_template_kwargs),
            session_id=_resolve_session(request, req.session_id, key),
            rewrite_policy=check_policy(req.rewrite_policy) if req.rewrite_policy is not None else None,
            parse_tool_calls=bool(req.tools) and req.tool_choice != "none",
            request_key=key,
            retry=_is_retry(request),
        )
        events = gateway.chat(call)
        started = await start(events)
        wire = WireBuilder(tokenizer, req.model, "chat", started.session_id, started.prompt_token_ids)
        headers = {"X-Session-ID": started.session_id}
        if not req.stream:
            done = await _until_done_or_gone(request, events)
            return json_response(wire.chat_completion(done, top), headers=headers)
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            opened: set[int] = set()
            produced = 0
            async for event in events:
                if isinstance(event, TextDelta):
                    yield wire.chat_chunk(
                        event.index,
                        text=event.text,
                        reasoning=event.reasoning,
                        tokens=event.tokens,
                        top=top,
                        first=event.index not in opened,
                    )
                    opened.add(event.index)
                elif isinstance(event, ChoiceDone):
                    produced += len(event.tokens)
                    yield wire.chat_chunk(
                        event.index,
                        tool_calls=event.reply.tool_calls,
                        finish_reason=event.finish_reason,
                        first=event.index not in opened,
                    )
                    opened.add(event.index)
            if include_usage:
                yield wire.usage_chunk(produced, "chat.completion.chunk")

        return StreamingResponse(sse(chunks()), media_type="text/event-stream", headers=headers)

    @openai_routes.post("/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        req, _ = await _parse(request, CompletionRequest)
        key = _request_key(request, await request.body())
        check_model(req.model)
        prompt = _single_prompt(req.prompt)
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise InvalidRequest("logprobs must be between 0 and 5 for completions", param="logprobs")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
        sampling = _sampling(req, max_tokens, logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0)
        call = CompletionCall(
            prompt=prompt,
            sampling=sampling,
            session_id=_resolve_session(request, req.session_id, key),
            request_key=key,
            retry=_is_retry(request),
        )
        events = gateway.complete(call)
        started = await start(events)
        wire = WireBuilder(tokenizer, req.model, "completion", started.session_id, started.prompt_token_ids)
        echo = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) if req.echo else ""
        headers = {"X-Session-ID": started.session_id}
        if not req.stream:
            done = await _until_done_or_gone(request, events)
            return json_response(wire.completion(done, req.logprobs, echo), headers=headers)
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            opened: set[int] = set()
            produced = 0
            async for event in events:
                first = event.index not in opened if isinstance(event, (TextDelta, ChoiceDone)) else False
                if isinstance(event, TextDelta):
                    text = (echo if first else "") + event.text
                    yield wire.completion_chunk(event.index, text, event.tokens, req.logprobs, None, first)
                    opened.add(event.index)
                elif isinstance(event, ChoiceDone):
                    produced += len(event.tokens)
                    yield wire.completion_chunk(event.index, "", [], req.logprobs, event.finish_reason, first)
                    opened.add(event.index)
            if include_usage:
                yield wire.usage_chunk(produced, "text_completion")

        return StreamingResponse(sse(chunks()), media_type="text/event-stream", headers=headers)

    @openai_routes.get("/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served(),
                    "object": "model",
                    "created": int(app.state.started),
                    "owned_by": "tokentape",
                    "max_model_len": gateway.engine.context_length,
                }
            ],
        }

    @openai_routes.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": served(),
            "sessions_in_memory": len(gateway.sessions),
            "requests_active": gateway.active,
            "engine_calls": gateway.engine_calls,
            "tokens_generated": getattr(gateway.engine, "tokens_generated", None),
        }

    @openai_routes.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> dict[str, Any]:
        req, raw = await _parse(request, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("send either 'prompt' or 'messages'", param="prompt")
        if req.prompt is not None:
            tokens = tokenizer.encode(req.prompt)
        else:
            messages = [flatten_text_parts(m) for m in raw["messages"]]
            options = RenderOptions(tools=req.tools, template_kwargs=req.chat_template_kwargs)
            text = gateway.renderer.render_text(messages, req.add_generation_prompt, options)
            tokens = tokenizer.encode(text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": gateway.engine.context_length}

    @openai_routes.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        req, _ = await _parse(request, DetokenizeRequest)
        check_model(req.model)
        if any(not 0 <= t < tokenizer.vocab_size for t in req.tokens):
            raise InvalidRequest(f"token IDs must be between 0 and {tokenizer.vocab_size - 1}", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    app.include_router(openai_routes, prefix="/v1")
    app.include_router(openai_routes, prefix="/sessions/{session_id}/v1", dependencies=[Depends(_session_path)])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"], openapi_extra=_body_schema(TokenizeRequest))
    app.add_api_route("/detokenize", detokenize, methods=["POST"], openapi_extra=_body_schema(DetokenizeRequest))

    add_session_routes(app, gateway)
    add_admin_routes(app, gateway)
    app.state.started = time.time()
    return app

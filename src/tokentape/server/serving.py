"""The serving layer every generation route shares. A dialect (one API family: OpenAI chat,
completions and Responses, Anthropic Messages, vLLM's token route, and any added later) declares its
path, request model and error shape, and supplies three methods: `to_call` (its request as a gateway
call), `respond` (the gateway's events as its response) and `stream` (the same as its stream). The
registry of dialects (`server.dialects`) builds the routes from these. This module does the rest, the
same way for all: error shape, session naming, retry identity, the first event before any byte is
sent (so planning errors are proper error responses), and stopping generation when the client goes.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import orjson
import pydantic
import xxhash
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokentape.core.held import HeldBytes
from tokentape.core.reply import ToolFormat
from tokentape.engines.remote.wire import quote
from tokentape.errors import NotFound, TokentapeError
from tokentape.gateway.calls import Call, ChoiceDone, Event, Started
from tokentape.gateway.service import Gateway
from tokentape.render.tokenizer import Tokenizer
from tokentape.server.bodies import json_object
from tokentape.server.dialects.common import Caller, WireRequest
from tokentape.server.dialects.images import ImageIntake, ImageLimits
from tokentape.server.errors import ErrorShape, invalid_from_validation, json_response, use_error_shape
from tokentape.server.image_urls import fetch_remote_images, remote_image_urls
from tokentape.server.reparse import PendingParse, Reparser
from tokentape.server.session_names import SESSION_HEADER, harness_session, named_session

__all__ = ["Caller", "Dialect", "DialectContext", "Serving", "SESSION_HEADER", "RETRY_HEADER"]

PREFIX_MATCH_HEADER = "X-Tokentape-Prefix-Match"  # matched | new | ambiguous | unmatched (serve --match-prefix)
RETRY_HEADER = "x-stainless-retry-count"  # what the openai and anthropic SDKs send on a retry
CLIENT_GONE = 499  # the status of a whole answer whose client left before it was made (nginx's code)
_NAMED_KEY_SEED = 0x746F6B656E746170  # fixed: keys are stored with their turns

Req = TypeVar("Req", bound=WireRequest)
Handler = Callable[[Request], Coroutine[Any, Any, Response]]


@dataclass(frozen=True, slots=True)
class DialectContext:
    """What a dialect may need of the gateway it serves."""

    tokenizer: Tokenizer
    tool_format: ToolFormat  # the model's tool-call syntax, for enforced tool choices
    reasoning: bool  # the chat template reads `enable_thinking`
    context_length: int
    vision: bool = False  # the model has an image processor: image parts are taken
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    image_refusal: Callable[[int, int], str | None] | None = None  # the processor's size rule
    # "always": every response names its prompt's token IDs; "asked": only a request with
    # `return_token_ids: true` gets them (they grow with the history: an agent that never reads them
    # then neither waits for nor parses them)
    prompt_token_ids: str = "always"
    held: HeldBytes | None = None  # the gateway's account of what it holds, for what a dialect keeps

    def image_intake(self) -> ImageIntake:
        """A fresh intake for one request's images."""
        return ImageIntake(self.image_limits, vision=self.vision, refusal=self.image_refusal)


class Dialect(abc.ABC, Generic[Req]):
    """One API family's generation route: request translation, response and stream rendering."""

    path: ClassVar[str]  # e.g. "/v1/chat/completions"; also served under /sessions/{session_id}
    errors: ClassVar[ErrorShape]
    request_model: type[Req]
    media_type: ClassVar[str] = "text/event-stream"
    history_field: ClassVar[str | None] = None  # the body's array an agent resends whole every call
    stream_end: ClassVar[bytes] = b""  # the stream's end marker, after the last event (and after an error event)

    def __init__(self, context: DialectContext) -> None:
        self.context = context
        self.tokenizer = context.tokenizer
        self.tool_format = context.tool_format

    def shows_prompt(self, req: Req) -> bool:
        """Whether the response carries `prompt_token_ids`."""
        return self.context.prompt_token_ids == "always" or bool(req.return_token_ids)

    @abc.abstractmethod
    def to_call(self, req: Req, raw: dict[str, Any], caller: Caller) -> Call:
        """The request as a gateway call; raises InvalidRequest for what the gateway cannot express.
        Everything that can fail runs here, before the turn is recorded."""

    @abc.abstractmethod
    def respond(self, req: Req, call: Call, started: Started, choices: list[ChoiceDone]) -> dict[str, Any]:
        """The whole response body once every choice is done (the turn is recorded by then)."""

    @abc.abstractmethod
    def stream(self, req: Req, call: Call, started: Started, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The events as framed stream bytes (without the end marker)."""


class Serving:
    """Binds the gateway to the routes; `route(dialect)` is the handler for one dialect."""

    def __init__(self, gateway: Gateway, model_id: str | None) -> None:
        self.gateway = gateway
        self._model_id = model_id
        self.tokenizer: Tokenizer = gateway.renderer.tokenizer
        self.reparser = Reparser()
        gateway.sessions.held.add("parses", lambda: self.reparser.held_bytes, self.reparser.shed)

    @property
    def model(self) -> str:
        """The model name clients send: fixed, or the engines' own (learnt when they answer)."""
        return self._model_id or self.gateway.engine.model_id

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise NotFound(  # the name quoted in part: a 10 MB one is not sent back whole
                f"the model '{quote(name)}' does not exist; this server serves '{self.model}'",
                param="model",
                code="model_not_found",
            )

    def check_body_model(self, raw: dict[str, Any]) -> None:
        """`check_model` on a body's `model` before validation: a string is what validation keeps
        (every dialect's `model` is a strict string), anything else is left for validation to refuse."""
        name = raw.get("model")
        if type(name) is str:
            self.check_model(name)

    def route(self, dialect: Dialect[Any]) -> Handler:
        async def handle(request: Request) -> Response:
            use_error_shape(request, dialect.errors)
            parse = self._parser(request, dialect)
            # the model first: a body for a model not served is refused (404) before it is walked or
            # validated, which for megabytes of tools cost seconds of CPU a request
            raw = await json_object(request, parse=parse, first=self.check_body_model)
            if dialect.context.image_limits.allow_fetch:  # the operator's choice: image URLs fetched here
                await self._fetch_images(raw, dialect.context.image_limits)
            try:
                req = dialect.request_model.model_validate(raw)
            except pydantic.ValidationError as exc:
                raise invalid_from_validation(exc) from exc
            caller = self.caller(request, raw, await request.body())
            streams = bool(req.stream)
            call = await _to_call(dialect, req, raw, caller, await request.body())
            events = self.gateway.run(call, streamed=streams)
            started = await _first(events)
            if type(parse) is PendingParse:  # accepted: only now is its parse kept for the next body
                parse.keep()
            headers = {"X-Session-ID": started.session_id}
            if started.prefix_match is not None:
                headers[PREFIX_MATCH_HEADER] = started.prefix_match.outcome
            if not streams:
                choices = await _until_done_or_gone(request, events)
                if choices is None:  # the client left: nobody reads an answer, and none is made
                    return Response(status_code=CLIENT_GONE, headers=headers)
                return json_response(dialect.respond(req, call, started, choices), headers=headers)
            body = _framed(dialect, dialect.stream(req, call, started, events), events)
            return EventStream(body, media_type=dialect.media_type, headers=headers)

        return handle

    def _parser(self, request: Request, dialect: Dialect[Any]) -> Callable[[bytes], Any]:
        """The body's parser: one that reuses the parse of the history the session's last body carried,
        where the session is named before the body is read (base URL, header or session key). Not
        where image URLs are fetched: that rewrites the parsed messages in place."""
        field = dialect.history_field
        session = request.path_params.get("session_id") or request.headers.get(SESSION_HEADER)
        if not session and (harness := harness_session(request.headers, None)) is not None:
            session = harness[0]
        if field is None or not session or dialect.context.image_limits.allow_fetch:
            return orjson.loads
        return self.reparser.parser(session, field)

    async def _fetch_images(self, raw: dict[str, Any], limits: ImageLimits) -> None:
        """Fetching holds an admission slot, as generating does: past `--max-active` a request is
        refused (429) before it fetches, so fetches cannot pile up behind the engine."""
        if not remote_image_urls(raw):
            return
        admission = self.gateway.admission
        admission.take()
        try:
            await fetch_remote_images(raw, limits.fetch_rules())
        finally:
            admission.give()

    def caller(self, request: Request, raw: dict[str, Any], body: bytes) -> Caller:
        """Who the request is: the session it names (`session_names`: one precedence, one conflict
        rule, every name it carries checked), its retry identity and its trace id."""
        retry = _is_retry(request)
        named = named_session(request.path_params.get("session_id"), request.headers, raw)
        session_id = named.session_id
        key = request_key(request.scope["path"], body, named=session_id is not None)
        if session_id is None and retry:  # a retry of an unnamed call goes to the session its first attempt opened
            session_id = self.gateway.sessions.unnamed_session(key)
        return Caller(session_id, key, retry, named.trace_id, named.harness)


def request_key(path: str, body: bytes, *, named: bool) -> bytes:
    """16 bytes naming a request's route and body, for SDK retries.

    A retry of an unnamed call finds its session by its key, so that key is cryptographic: no client
    may craft another's (SHA-256, on the CPU's SHA instructions: 0.25 ms for a 430 KB history, about
    114k tokens). A named call's key is only ever looked up among its own session's requests, where a
    crafted collision could only replay that session's own answer: xxh3-128 (0.02 ms for the same
    history), seeded with a constant so a retry still matches after a restart."""
    digest = (
        xxhash.xxh3_128(path.encode() + b"\0", seed=_NAMED_KEY_SEED) if named else hashlib.sha256(path.encode() + b"\0")
    )
    digest.update(body)
    return digest.digest()[:16]


OFF_LOOP_BODY = 256 * 1024  # a body this large is made a call on a worker thread


async def _to_call(dialect: Dialect[Any], req: Any, raw: dict[str, Any], caller: Caller, body: bytes) -> Call:
    """The dialect's call; on a worker thread for a large body or one that carries base64 data
    (images, decoded there: `dialects.images`), so that none of it holds the event loop."""
    if len(body) < OFF_LOOP_BODY and b"base64" not in body:
        return dialect.to_call(req, raw, caller)
    return await asyncio.to_thread(dialect.to_call, req, raw, caller)


def _is_retry(request: Request) -> bool:
    try:
        return int(request.headers.get(RETRY_HEADER, "0")) > 0
    except ValueError:
        return False


async def _first(events: AsyncGenerator[Event, None]) -> Started:
    """The first event; planning errors surface here, before any byte is sent."""
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    assert isinstance(first, Started)
    return first


async def _framed(
    dialect: Dialect[Any], chunks: AsyncIterator[bytes], events: AsyncGenerator[Event, None]
) -> AsyncIterator[bytes]:
    """A dialect's stream with its end marker; an error after the first byte becomes an in-stream
    error event. The gateway's events are closed whatever happens, which releases the request."""
    try:
        async for chunk in chunks:
            yield chunk
    except TokentapeError as exc:
        yield dialect.errors.stream_event(exc)
    finally:
        await events.aclose()
    yield dialect.stream_end


class EventStream(StreamingResponse):
    """A generation's stream, which stops when the client goes. Starlette's own watches for that in
    an anyio task group, whose set-up and cancellation (it formats the task's repr) cost about 70 us
    a response; this watches as whole answers do (`_until_gone`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with _until_gone(receive):
                await self.stream_response(send)
        finally:  # the watcher is gone by now: nothing cancels this
            if isinstance(self.body_iterator, AsyncGenerator):
                await self.body_iterator.aclose()  # where a cancellation left it waiting on `send`
        if self.background is not None:
            await self.background()


async def _until_done_or_gone(request: Request, events: AsyncGenerator[Event, None]) -> list[ChoiceDone] | None:
    """Collect a non-streamed response; if the client goes away first, stop generating (the turn is
    recorded as aborted with what was sampled, and nobody reads the answer: None is returned)."""
    choices: list[ChoiceDone] | None = None
    async with _until_gone(request.receive), contextlib.aclosing(events) as stream:
        choices = [event async for event in stream if isinstance(event, ChoiceDone)]
    return choices


@contextlib.asynccontextmanager
async def _until_gone(receive: Receive) -> AsyncIterator[None]:
    """Runs the block in this task; a watcher task cancels it if the client disconnects first, and
    that cancellation ends here. Any other cancellation goes on up."""
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not left:
            raise
    finally:
        # nothing suspends between the block's end and here, so the watcher cannot cancel afterwards
        watcher.cancel()
    if left:  # the client left (or a step below took its cancellation as its own): take the task back
        task.uncancel()

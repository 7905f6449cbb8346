"""The HTTP/SSE exchange every remote adapter shares, and the one place where what goes wrong in it
becomes an error of tokentape's tree (`exchange_errors`).

Connections: each engine gets one pool of keep-alive connections for generations (`engines/http1.py`),
released on every way out of a request (finished, failed, cancelled), and two aiohttp pools
(`engines/http.py`): a small one for aborts and control calls, and one for health probes, so that a
busy or wedged generation pool never makes a live engine look dead.

Errors: a transport failure or a 5xx is `EngineFailure` (counts against the engine's health); a 4xx
about this request is the request's error; anything the engine sends that its wire format does not
allow is `EngineProtocolError` (502 with the engine's words; the engine stays in rotation). Two
failures say nothing about the engine's health and keep it in rotation: a response head that does not
come in time (one stuck exchange; the health probe judges the engine) and an error event the engine
streams about this request (it answered, so it is alive).
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from typing import Any, ClassVar

import aiohttp
import orjson

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, LogprobMode, SampledToken
from tokentape.engines.http import ConnectionPool, lines_ahead
from tokentape.engines.http1 import Http1Pool, PoolTimeout, TransportError
from tokentape.engines.remote.wire import json_object, quote, token_id, token_ids
from tokentape.errors import ContextOverflow, EngineFailure, InvalidRequest

__all__ = ["EngineAnswered", "RemoteEngine", "exchange_errors", "run_to_completion"]

SESSION_HEADER = "X-Session-ID"  # lets an engine-side router keep a session on its prefix cache
PROBE_TIMEOUT = 5.0  # seconds for a health probe or model discovery, on their own connection
CONTROL_TIMEOUT = 300.0  # seconds for a control call: loading weights can take minutes
CONNECT_TIMEOUT = 10.0
POOL_TIMEOUT = 30.0  # waiting for a free pooled connection
# vLLM and SGLang answer a streamed request with its head at once (tokens follow): a head that does not
# come is one stuck exchange, failed and retried on another connection rather than waited on for minutes
HEAD_TIMEOUT = 20.0
KEEPALIVE_EXPIRY = 4.0  # below the 5 s after which uvicorn (vLLM's and SGLang's server) drops idle connections
MAX_CONNECTIONS = 256
DRAIN_TIMEOUT = 1.0  # seconds to read what follows the last event, so that the connection can be reused

# Cleanup that must finish even when the request that started it is cancelled (kept referenced here).
_cleanup: set[asyncio.Task[Any]] = set()


async def run_to_completion(work: Awaitable[Any]) -> None:
    """Run `work` in its own task and wait for it; if the caller is cancelled meanwhile, the work still
    finishes (a cancelled scope would otherwise cancel every await of a `finally` block)."""
    task = asyncio.ensure_future(work)
    _cleanup.add(task)
    task.add_done_callback(_cleanup.discard)
    await asyncio.shield(task)


def _header_value(session_id: str) -> str:
    """A session id as a header value that is always legal (ids are checked upstream; this is the backstop)."""
    if session_id.isascii() and session_id.isprintable():
        return session_id
    return urllib.parse.quote(session_id, safe="")


class EngineAnswered(Exception):
    """The engine answered with an error: an HTTP status >= 400 (`status`), or an error event inside
    a streamed answer (`status` None; the event's own `code`, if any, says whose fault it is).
    Raised inside `exchange_errors`, which turns it into tokentape's error."""

    def __init__(self, status: int | None, error: object, code: object = None) -> None:
        super().__init__(status, error)
        self.status = status
        self.code = code
        self.words = quote(str(error))

    @classmethod
    def from_body(cls, status: int, body: bytes) -> EngineAnswered:
        """An error answer, quoted in the engine's own words (its JSON error's message where it has one)."""
        text = body.decode(errors="replace")
        try:
            data = orjson.loads(body)
            error = data.get("error") if isinstance(data, dict) else None
            message = error.get("message") if isinstance(error, dict) else None
            message = message or (data.get("message") if isinstance(data, dict) else None) or error or text
        except (ValueError, RecursionError):
            message = text
        return cls(status, message)

    @classmethod
    def from_event(cls, error: object) -> EngineAnswered:
        """An `{"error": ...}` event in a stream."""
        code = error.get("code") if isinstance(error, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        return cls(None, message or error, code)


def mapped(
    exc: BaseException, url: str, *, sending: bool = False, head_timeout: float | None = None
) -> Exception | None:
    """The error of tokentape's tree that `exc`, raised in an exchange with the engine at `url`, stands
    for; None for what is not the exchange's to map (it passes through unchanged). `sending`: raised
    while the request was sent and its head awaited (for at most `head_timeout` seconds)."""
    if isinstance(exc, EngineAnswered):
        if exc.status is None:  # an error event: the engine is alive and named this request's failure
            if isinstance(exc.code, int) and 400 <= exc.code < 500:
                return InvalidRequest(f"the engine refused the request: {exc.words}")
            failure = EngineFailure(f"the engine reported an error: {exc.words}")
            failure.engine_down = False
            return failure
        if exc.status == 400 and ("context" in exc.words.lower() or "too long" in exc.words.lower()):
            return ContextOverflow(f"the engine refused the prompt: {exc.words}", param="messages")
        if 400 <= exc.status < 500 and exc.status not in (408, 429):
            return InvalidRequest(f"the engine refused the request: {exc.words}")
        return EngineFailure(f"the engine answered {exc.status}: {exc.words}")
    if isinstance(exc, (aiohttp.ConnectionTimeoutError, PoolTimeout)):  # waited for a pooled connection too long
        return EngineFailure(f"no connection to the engine at {url} came free in time")
    if isinstance(exc, (aiohttp.ClientError, TransportError)):
        return EngineFailure(f"the engine at {url} failed{'' if sending else ' mid-answer'}: {exc!r}")
    if isinstance(exc, TimeoutError):
        if not sending:  # the answer stopped coming
            return EngineFailure(f"the engine at {url} failed mid-answer: {exc!r}")
        failure = EngineFailure(f"the engine at {url} sent no answer within {head_timeout or 0:.0f} s")
        failure.engine_down = False  # one stuck exchange; the health probe judges the engine
        return failure
    if isinstance(exc, (ValueError, TypeError)) and sending:
        # before anything was sent: e.g. a header value that HTTP does not allow
        return InvalidRequest(f"the request cannot be sent to the engine: {exc}")
    return None


@contextlib.contextmanager
def exchange_errors(url: str, *, sending: bool = False, head_timeout: float | None = None) -> Iterator[None]:
    """Map what goes wrong inside to tokentape's errors (`mapped`). `sending`: the block sends a
    request and waits at most `head_timeout` seconds for its head (a timeout there is that wait's,
    and a ValueError or TypeError is the request's); otherwise it reads an answer."""
    try:
        yield
    except (EngineAnswered, aiohttp.ClientError, TransportError, TimeoutError, ValueError, TypeError) as exc:
        error = mapped(exc, url, sending=sending, head_timeout=head_timeout)
        if error is None:
            raise
        raise error from (None if isinstance(exc, EngineAnswered) else exc)


class RemoteEngine:
    """Shared plumbing: pooled HTTP client, health probe, load counters, the exchange and its errors."""

    kind: ClassVar[str] = "remote"
    logprobs_modes: ClassVar[tuple[str, ...]] = ()  # the server-side settings this adapter understands
    constraint_kinds: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        context_length: int = 32768,
        timeout: float = 600.0,
        max_connections: int = MAX_CONNECTIONS,
        logprobs_mode: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_id = model or "default"
        self.context_length = context_length
        if logprobs_mode is not None and logprobs_mode not in self.logprobs_modes:
            raise InvalidRequest(
                f"{self.kind} engines report logprobs as one of {', '.join(self.logprobs_modes) or 'nothing else'}; "
                f"got {logprobs_mode!r}",
                param="engine",
            )
        self.logprobs_mode = logprobs_mode or (self.logprobs_modes[0] if self.logprobs_modes else "")
        self.vocab_size: int | None = None  # set by whoever knows the tokenizer: IDs beyond it are faults
        self.http = Http1Pool(
            self.base_url,
            limit=max_connections,
            keepalive=KEEPALIVE_EXPIRY,
            connect_timeout=CONNECT_TIMEOUT,
            pool_timeout=POOL_TIMEOUT,
            read_timeout=timeout,  # the longest silence, before the head as after it
        )
        # Probes and aborts are rare and get a connection each, closed after use: an idle pooled one would
        # sit in CLOSE_WAIT once the engine drops it, since a pool only notices that on its next use.
        self.probe = ConnectionPool(
            self.base_url, limit=2, keepalive=None, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)
        )
        # aborts and other short calls: never queued behind generations or in the way of health probes
        self.control = ConnectionPool(
            self.base_url, limit=16, keepalive=None, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)
        )
        self.in_flight = 0
        self.healthy = True
        self.draining = False
        self.tokens_generated = 0

    async def discover(self) -> None:
        """Ask the server which model it serves (and its context length, where it says)."""
        try:
            async with self.probe.session().get("/v1/models") as response:
                models = orjson.loads(await response.read())["data"]
            if models:
                self.model_id = str(models[0].get("id", self.model_id))
                self.context_length = int(models[0].get("max_model_len") or self.context_length)
                self._served(models)
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError, TypeError, AttributeError, IndexError):
            return

    def _served(self, models: list[Any]) -> None:
        """What an adapter reads from the models the server lists, beyond the first one's name."""

    async def check_health(self) -> bool:
        """Probe `/health` on the probe's own connection, never through the generation pool."""
        try:
            async with self.probe.session().get("/health") as response:
                self.healthy = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            self.healthy = False
        return self.healthy

    def logprob_mode(self, params: SamplingParams) -> LogprobMode:
        raise NotImplementedError  # each wire dialect

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
        raise NotImplementedError  # each wire dialect

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "url": self.base_url,
            "model": self.model_id,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "tokens_generated": self.tokens_generated,
            "logprobs_mode": self.logprobs_mode,
        }

    async def close(self) -> None:
        for pool in (self.http, self.control, self.probe):
            await pool.close()

    def _check_constraint(self, constraint: Constraint | None) -> None:
        if constraint is not None and constraint.kind not in self.constraint_kinds:
            raise InvalidRequest(
                f"the {self.kind} engine cannot constrain output by {constraint.kind.replace('_', ' ')}",
                param="response_format",
            )

    def _token(self, value: object, what: str = "token id") -> int:
        return token_id(value, self.vocab_size, what)

    def _token_ids(self, values: list[Any]) -> list[int]:
        return token_ids(values, self.vocab_size)

    # -- the exchange --------------------------------------------------------------------------------
    async def _events(
        self,
        path: str,
        body: dict[str, Any],
        session_id: str | None,
        final: Callable[[dict[str, Any]], bool],
    ) -> AsyncGenerator[tuple[dict[str, Any], bool], None]:
        """POST `body` and yield each JSON event of the answer: the `data:` lines of an event stream, or
        the whole body when the server answered plain JSON. The response is closed on every way out.
        Each comes with whether more of the answer was read with it (`lines_ahead`): events that came
        together, which a stream may pass on as one.

        Before the `final` event (the one that says the generation finished) is yielded, the rest of
        the answer is read: the caller usually stops at that event's last token, and a response read
        to its end leaves its connection in the pool for the next request instead of closing it."""
        headers = {"Content-Type": "application/json"}
        if session_id:
            headers[SESSION_HEADER] = _header_value(session_id)
        # a streamed answer starts at once; an answer in one piece comes when the generation is over
        head_timeout = HEAD_TIMEOUT if body.get("stream") else None
        data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        with exchange_errors(self.base_url, sending=True, head_timeout=head_timeout):
            if head_timeout is None:  # bounded by the pool's silence timeout alone
                response = await self.http.post(path, data, headers)
            else:
                async with asyncio.timeout(head_timeout):
                    response = await self.http.post(path, data, headers)
        complete = False
        try:
            with exchange_errors(self.base_url):
                if response.status >= 400:
                    raise EngineAnswered.from_body(response.status, await response.read())
                if response.content_type == "application/json":
                    event = json_object(await response.read())
                    complete = True
                    response.release()  # back in the pool now, however long the caller keeps this open
                    yield event, False
                    return
                stream = lines_ahead(response.chunks())
                last: dict[str, Any] | None = None
                async for line, ahead in stream:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, `event:`/`id:` fields
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        complete = True
                        return
                    event = json_object(payload)
                    if "error" in event and not event.get("choices"):
                        raise EngineAnswered.from_event(event["error"])
                    if final(event):
                        last = event
                        break
                    yield event, ahead
                else:
                    complete = True
                if last is not None:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(DRAIN_TIMEOUT):
                            async for _ in stream:  # normally just `data: [DONE]`
                                pass
                            complete = True
                            response.release()
                    yield last, False
        finally:
            # a response read to its end returns its connection to the pool (released once); any other
            # is closed, which is how the engine learns that nobody reads this generation any more
            if complete:
                response.release()
            else:
                response.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        params: dict[str, str] | None = None,
        timeout: float = CONTROL_TIMEOUT,
    ) -> object:
        """A control call (pause, load, resume...) on the control pool, with its own timeout; its JSON
        answer (its text when it is no JSON, None when it is empty). Errors mapped like a generation's."""
        with exchange_errors(self.base_url, sending=True, head_timeout=timeout):
            async with asyncio.timeout(timeout):
                session = self.control.session()
                async with session.request(
                    method, path, json=body, params=params, timeout=aiohttp.ClientTimeout(total=timeout)
                ) as response:
                    raw = await response.read()
                    if response.status >= 400:
                        raise EngineAnswered.from_body(response.status, raw)
        try:
            return orjson.loads(raw) if raw else None
        except ValueError:
            return raw.decode(errors="replace")

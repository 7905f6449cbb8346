"""Remote engines over HTTP, token IDs in and out: vLLM (`/v1/completions` with a token-ID prompt and
`return_token_ids`, or its `/inference/v1/generate` token endpoint) and SGLang (`/generate` with
`input_ids`). Answers are streamed, so closing the generation closes the upstream request and the
engine stops generating; for a caller that reads only the result (`whole`) the answer comes in one
piece, and closing that still closes the request, which vLLM and SGLang take as an abort (SGLang is
sent `/abort_request` as well). Sampled token IDs and logprobs are read from the response, never from text.

Connections (aiohttp, `engines/http.py`): each engine gets one pool of keep-alive connections for
generations, released on every way out of a request (finished, failed, cancelled), a small one for
aborts, and one for health probes, so that a busy or wedged generation pool never makes a live engine
look dead.

Errors: a transport failure or a 5xx is `EngineFailure` (counts against the engine's health); a 4xx
about this request is the request's error; anything the engine sends that its wire format does not
allow is `EngineProtocolError` (502 with the engine's words; the engine stays in rotation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import urllib.parse
import uuid
from array import array
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, ClassVar

import aiohttp
import numpy
import orjson

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, LogprobMode, SampledToken, logprob_mode
from tokentape.engines.http import ConnectionPool, lines
from tokentape.errors import ContextOverflow, EngineFailure, EngineProtocolError, InvalidRequest

__all__ = [
    "ENGINE_KINDS",
    "RemoteEngine",
    "SGLangEngine",
    "VLLMEngine",
    "VLLMGenerateEngine",
    "make_engine",
]

SESSION_HEADER = "X-Session-ID"  # lets an engine-side router keep a session on its prefix cache
PROBE_TIMEOUT = 5.0  # seconds for a health probe or model discovery, on their own connection
CONNECT_TIMEOUT = 10.0
POOL_TIMEOUT = 30.0  # waiting for a free pooled connection
# vLLM and SGLang answer a streamed request with its head at once (tokens follow): a head that does not
# come is one stuck exchange, failed and retried on another connection rather than waited on for minutes
HEAD_TIMEOUT = 20.0
KEEPALIVE_EXPIRY = 4.0  # below the 5 s after which uvicorn (vLLM's and SGLang's server) drops idle connections
MAX_CONNECTIONS = 256
DRAIN_TIMEOUT = 1.0  # seconds to read what follows the last event, so that the connection can be reused
LOGPROB_SLACK = 1e-3  # a logprob above 0 by more than rounding is not a log-probability
QUOTED = 200  # characters of an engine's answer quoted in an error

# Cleanup that must finish even when the request that started it is cancelled (kept referenced here).
_cleanup: set[asyncio.Task[Any]] = set()


async def _run_to_completion(work: Awaitable[Any]) -> None:
    """Run `work` in its own task and wait for it; if the caller is cancelled meanwhile, the work still
    finishes (a cancelled scope would otherwise cancel every await of a `finally` block)."""
    task = asyncio.ensure_future(work)
    _cleanup.add(task)
    task.add_done_callback(_cleanup.discard)
    await asyncio.shield(task)


def _quote(raw: object) -> str:
    text = raw if isinstance(raw, str) else repr(raw)
    return text if len(text) <= QUOTED else text[:QUOTED] + "..."


def _header_value(session_id: str) -> str:
    """A session id as a header value that is always legal (ids are checked upstream; this is the backstop)."""
    if session_id.isascii() and session_id.isprintable():
        return session_id
    return urllib.parse.quote(session_id, safe="")


class RemoteEngine:
    """Shared plumbing: pooled HTTP client, health probe, load counters, error mapping, SSE reading."""

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
        self.http = ConnectionPool(
            self.base_url,
            limit=max_connections,
            keepalive=KEEPALIVE_EXPIRY,
            # `connect` covers waiting for a pooled connection too; `sock_read` is the longest silence
            timeout=aiohttp.ClientTimeout(
                total=None, connect=POOL_TIMEOUT, sock_connect=CONNECT_TIMEOUT, sock_read=timeout
            ),
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
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError, TypeError, AttributeError, IndexError):
            return

    async def check_health(self) -> bool:
        """Probe `/health` on the probe's own connection, never through the generation pool."""
        try:
            async with self.probe.session().get("/health") as response:
                self.healthy = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            self.healthy = False
        return self.healthy

    def logprob_mode(self, params: SamplingParams) -> LogprobMode:
        raise NotImplementedError  # each wire dialect below

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
        raise NotImplementedError  # each wire dialect below

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

    # -- pieces the dialects share -------------------------------------------------------------------
    def _check_constraint(self, constraint: Constraint | None) -> None:
        if constraint is not None and constraint.kind not in self.constraint_kinds:
            raise InvalidRequest(
                f"the {self.kind} engine cannot constrain output by {constraint.kind.replace('_', ' ')}",
                param="response_format",
            )

    def _token(self, value: object, what: str = "token id") -> int:
        if type(value) is not int or value < 0 or (self.vocab_size is not None and value >= self.vocab_size):
            raise EngineProtocolError(f"the engine sent {what} {_quote(value)}, not a token of this model")
        return value

    def _token_ids(self, values: list[Any]) -> list[int]:
        """`values` if every one is a token of this model (one loop, no call per token)."""
        vocab = self.vocab_size if self.vocab_size is not None else 1 << 62
        for value in values:
            if type(value) is not int or not 0 <= value < vocab:
                self._token(value)  # raises, naming the value
        return values

    def _error_from(self, status: int, body: bytes) -> Exception:
        """The error a non-2xx answer stands for, with the engine's own words."""
        text = body.decode(errors="replace")
        try:
            data = orjson.loads(body)
            error = data.get("error") if isinstance(data, dict) else None
            message = error.get("message") if isinstance(error, dict) else None
            message = message or (data.get("message") if isinstance(data, dict) else None) or error or text
        except (ValueError, RecursionError):
            message = text
        words = _quote(str(message))
        if status == 400 and ("context" in words.lower() or "too long" in words.lower()):
            return ContextOverflow(f"the engine refused the prompt: {words}", param="messages")
        if 400 <= status < 500 and status not in (408, 429):
            return InvalidRequest(f"the engine refused the request: {words}")
        return EngineFailure(f"the engine answered {status}: {words}")

    async def _events(
        self,
        path: str,
        body: dict[str, Any],
        session_id: str | None,
        final: Callable[[dict[str, Any]], bool],
    ) -> AsyncGenerator[dict[str, Any], None]:
        """POST `body` and yield each JSON event of the answer: the `data:` lines of an event stream, or
        the whole body when the server answered plain JSON. The response is closed on every way out.

        Before the `final` event (the one that says the generation finished) is yielded, the rest of
        the answer is read: the caller usually stops at that event's last token, and a response read
        to its end leaves its connection in the pool for the next request instead of closing it."""
        headers = {"Content-Type": "application/json"}
        if session_id:
            headers[SESSION_HEADER] = _header_value(session_id)
        # a streamed answer starts at once; an answer in one piece comes when the generation is over
        head_timeout = HEAD_TIMEOUT if body.get("stream") else None
        response = await self._send(path, orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), headers, head_timeout)
        complete = False
        try:
            if response.status >= 400:
                raise self._error_from(response.status, await response.read())
            if response.content_type == "application/json":
                event = _json_object(await response.read())
                complete = True
                yield event
                return
            stream = lines(response)
            last: dict[str, Any] | None = None
            async for line in stream:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, `event:`/`id:` fields
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    complete = True
                    return
                event = _json_object(payload)
                if "error" in event and not event.get("choices"):
                    raise self._stream_error(event["error"])
                if final(event):
                    last = event
                    break
                yield event
            else:
                complete = True
            if last is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DRAIN_TIMEOUT):
                        async for _ in stream:  # normally just `data: [DONE]`
                            pass
                        complete = True
                yield last
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineFailure(f"the engine at {self.base_url} failed mid-answer: {exc!r}") from exc
        finally:
            # a response read to its end returns its connection to the pool; any other is closed, which
            # is how the engine learns that nobody reads this generation any more
            if complete:
                response.release()
            else:
                response.close()

    async def _send(
        self, path: str, data: bytes, headers: dict[str, str], head_timeout: float | None
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response head (a head that does not come in time is one stuck exchange)."""
        try:
            async with asyncio.timeout(head_timeout):
                return await self.http.session().post(path, data=data, headers=headers)
        except aiohttp.ClientConnectorError as exc:
            raise EngineFailure(f"the engine at {self.base_url} failed: {exc!r}") from exc
        except aiohttp.ConnectionTimeoutError as exc:
            raise EngineFailure(f"no connection to the engine at {self.base_url} came free in time") from exc
        except aiohttp.ClientError as exc:
            raise EngineFailure(f"the engine at {self.base_url} failed: {exc!r}") from exc
        except TimeoutError:
            failure = EngineFailure(f"the engine at {self.base_url} sent no answer within {head_timeout:.0f} s")
            failure.engine_down = False  # one stuck exchange; the health probe judges the engine
            raise failure from None
        except (ValueError, TypeError) as exc:  # e.g. a header value that HTTP does not allow
            raise InvalidRequest(f"the request cannot be sent to the engine: {exc}") from exc

    def _stream_error(self, error: object) -> Exception:
        code = error.get("code") if isinstance(error, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        words = _quote(str(message or error))
        if isinstance(code, int) and 400 <= code < 500:
            return InvalidRequest(f"the engine refused the request: {words}")
        failure = EngineFailure(f"the engine reported an error: {words}")
        failure.engine_down = False  # it answered and named this request's failure: it is alive
        return failure


def _json_object(raw: str | bytes) -> dict[str, Any]:
    try:
        event = orjson.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        event = None
    if not isinstance(event, dict):
        raise EngineProtocolError(f"the engine sent a line that is not a JSON object: {_quote(raw)}")
    return event


def _logprob(value: object) -> float:
    number = float(value) if type(value) in (int, float) else math.nan  # type: ignore[arg-type]  # bool is no number
    if not math.isfinite(number) or number > LOGPROB_SLACK:
        raise EngineProtocolError(
            f"the engine sent logprob {_quote(value)}; logprobs are finite numbers <= 0 "
            "(an engine reporting logits instead of logprobs is not supported)"
        )
    return min(number, 0.0)


def _logprobs(values: list[Any]) -> list[float]:
    """`_logprob` of each value, with the common case (a float in range) checked inline."""
    out: list[float] = []
    for value in values:
        if type(value) is float and -math.inf < value <= 0.0:
            out.append(value)
        else:
            out.append(_logprob(value))
    return out


def _token_text_id(token: object) -> int:
    """`token_id:N`, as vLLM spells tokens with `return_tokens_as_token_ids`."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    raise EngineProtocolError(
        f"the engine named a token {_quote(token)}, not `token_id:N` (is return_tokens_as_token_ids honoured?)"
    )


def _best_first(alternatives: list[tuple[int, float]], keep: int) -> tuple[tuple[int, float], ...]:
    """The `keep` most likely alternatives, best first (vLLM lists the sampled token first, whatever its rank)."""
    alternatives.sort(key=lambda pair: -pair[1])
    return tuple(alternatives[:keep])


def _wire_ids(tokens: Sequence[int]) -> Any:
    """Prompt token IDs as orjson writes them fastest. The tape hands over an int32 array; seen as a
    numpy array it is written in C without one Python int per token (0.27 against 3.4 ms at 128k)."""
    if isinstance(tokens, array) and tokens.itemsize == 4 and tokens.typecode in "il":
        return numpy.frombuffer(tokens, dtype=numpy.int32)
    return list(tokens)


def _sampling_fields(prompt: Sequence[int], params: SamplingParams, context: int, *, length_key: str) -> dict[str, Any]:
    """The sampling fields vLLM and SGLang name alike; each adapter adds its own dialect's."""
    room = context - len(prompt)
    return {
        length_key: room if params.max_tokens is None else min(params.max_tokens, room),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,  # -1 is "off" on both
        "min_p": params.min_p,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,  # stop tokens were sampled: their text stays
    }


def _vllm_structured_outputs(constraint: Constraint) -> dict[str, Any]:
    """vLLM's `structured_outputs` (StructuredOutputsParams): json, regex or grammar."""
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.value)
        except ValueError as exc:
            raise InvalidRequest(f"the JSON schema is not JSON: {exc}", param="response_format") from exc
        return {"json": schema}
    return {"regex" if constraint.kind == "regex" else "grammar": constraint.value}


class VLLMEngine(RemoteEngine):
    """vLLM's OpenAI server: `/v1/completions`, streamed, prompt as token IDs.

    `logprobs_mode` is the server's `--logprobs-mode`: raw_logprobs (vLLM's default: the model's own
    distribution, no temperature, no truncation) or processed_logprobs (after temperature and the
    top-k/top-p/min-p cut, renormalized).
    """

    kind = "vllm"
    logprobs_modes = ("raw_logprobs", "processed_logprobs")
    constraint_kinds = frozenset({"json_schema", "regex", "grammar"})
    path = "/v1/completions"

    def logprob_mode(self, params: SamplingParams) -> LogprobMode:
        if self.logprobs_mode == "processed_logprobs":
            return logprob_mode(params, scaled=True, truncated_by=("top_k", "top_p", "min_p"))
        return logprob_mode(params, scaled=False)

    def _body(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        seed: int | None,
        constraint: Constraint | None,
        whole: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_id,
            "prompt": _wire_ids(prompt),
            **_sampling_fields(prompt, params, self.context_length, length_key="max_tokens"),
            "stream": not whole,
            "logprobs": params.top_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed % 2**63
        if constraint is not None:
            body["structured_outputs"] = _vllm_structured_outputs(constraint)
        return body

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
        self._check_constraint(constraint)
        mode = self.logprob_mode(params)
        events = self._events(
            self.path, self._body(prompt, params, seed, constraint, whole), session_id, _choice_finished
        )
        try:
            async for event in events:
                for token in self._tokens(event, params, mode):
                    self.tokens_generated += 1
                    yield token
        finally:
            await events.aclose()

    def _tokens(self, event: dict[str, Any], params: SamplingParams, mode: LogprobMode) -> list[SampledToken]:
        """The sampled tokens of one completions event, checked against the wire format."""
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise EngineProtocolError(f"the engine sent an event without choices: {_quote(event)}")
        out: list[SampledToken] = []
        for choice in choices:
            if not isinstance(choice, dict):
                raise EngineProtocolError(f"the engine sent a choice that is not an object: {_quote(choice)}")
            logprobs = choice.get("logprobs") or {}
            if not isinstance(logprobs, dict):
                raise EngineProtocolError(f"the engine sent logprobs of an unexpected shape: {_quote(logprobs)}")
            ids = self._token_ids(_list(choice.get("token_ids"), "token_ids"))
            spelled = _list(logprobs.get("tokens"), "tokens")
            if spelled and spelled != [f"token_id:{t}" for t in ids]:  # the usual case is one comparison
                named = self._token_ids([_token_text_id(t) for t in spelled])
                if ids and named != ids:
                    raise EngineProtocolError(f"the engine's token_ids {_quote(ids)} and tokens {_quote(named)} differ")
                ids = named
            values = _logprobs(_list(logprobs.get("token_logprobs"), "token_logprobs"))
            tops = _list(logprobs.get("top_logprobs"), "top_logprobs") or [None] * len(ids)
            if len(values) != len(ids) or len(tops) != len(ids):
                raise EngineProtocolError(
                    f"the engine sent {len(ids)} token IDs with {len(values)} logprobs and {len(tops)} top_logprobs"
                )
            keep = params.top_logprobs
            if not keep:  # alternatives nobody asked for (vLLM lists the sampled token) are not read
                out += [SampledToken(token, value, (), mode) for token, value in zip(ids, values, strict=True)]
                continue
            for token, value, top in zip(ids, values, tops, strict=True):
                if top is not None and not isinstance(top, dict):
                    raise EngineProtocolError(f"the engine sent top_logprobs of an unexpected shape: {_quote(top)}")
                alternatives = [(self._token(_token_text_id(t)), _logprob(lp)) for t, lp in (top or {}).items()]
                out.append(SampledToken(token, value, _best_first(alternatives, keep), mode))
        return out


def _choice_finished(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def _meta_finished(event: dict[str, Any]) -> bool:
    meta = event.get("meta_info")
    return isinstance(meta, dict) and meta.get("finish_reason") is not None


def _list(value: object, name: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise EngineProtocolError(f"the engine sent {name} that is not a list: {_quote(value)}")
    return value


class VLLMGenerateEngine(VLLMEngine):
    """vLLM's token endpoint `/inference/v1/generate` (token IDs in, token IDs out), streamed: each event
    carries new `token_ids` and `logprobs.content[j]` = {token or token_id, logprob, top_logprobs}.
    A server that answers in one piece (no streaming on its side) is read the same way."""

    kind = "vllm-generate"
    path = "/inference/v1/generate"

    def _body(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        seed: int | None,
        constraint: Constraint | None,
        whole: bool,
    ) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            **_sampling_fields(prompt, params, self.context_length, length_key="max_tokens"),
            # vLLM lists the sampled token first and cuts the list at `logprobs` entries: one more
            # than asked keeps the k best whether or not the sampled token is among them
            "logprobs": params.top_logprobs + 1,
        }
        if seed is not None:
            sampling["seed"] = seed % 2**63
        if constraint is not None:
            sampling["structured_outputs"] = _vllm_structured_outputs(constraint)
        return {
            "model": self.model_id,
            "request_id": uuid.uuid4().hex,
            "token_ids": _wire_ids(prompt),
            "sampling_params": sampling,
            "stream": not whole,
        }

    def _tokens(self, event: dict[str, Any], params: SamplingParams, mode: LogprobMode) -> list[SampledToken]:
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise EngineProtocolError(f"the engine sent an event without choices: {_quote(event)}")
        out: list[SampledToken] = []
        for choice in choices:
            if not isinstance(choice, dict):
                raise EngineProtocolError(f"the engine sent a choice that is not an object: {_quote(choice)}")
            ids = [self._token(t) for t in _list(choice.get("token_ids"), "token_ids")]
            logprobs = choice.get("logprobs") or {}
            content = _list(logprobs.get("content") if isinstance(logprobs, dict) else logprobs, "logprobs.content")
            if len(content) != len(ids):
                raise EngineProtocolError(f"the engine sent {len(ids)} token IDs with {len(content)} logprobs")
            for token, entry in zip(ids, content, strict=True):
                if not isinstance(entry, dict):
                    raise EngineProtocolError(f"the engine sent a logprob entry {_quote(entry)}")
                if self._entry_token(entry) != token:
                    raise EngineProtocolError(f"the engine's logprob entry {_quote(entry)} is not for token {token}")
                alternatives = []
                for alt in _list(entry.get("top_logprobs"), "top_logprobs"):
                    if not isinstance(alt, dict):
                        raise EngineProtocolError(f"the engine sent a top_logprobs entry {_quote(alt)}")
                    alternatives.append((self._entry_token(alt), _logprob(alt.get("logprob"))))
                top = _best_first(alternatives, params.top_logprobs)
                out.append(SampledToken(token, _logprob(entry.get("logprob")), top, mode))
        return out

    def _entry_token(self, entry: dict[str, Any]) -> int:
        """An entry names its token as `token_id: N` or as `token: "token_id:N"`, by vLLM version."""
        if "token_id" in entry:
            return self._token(entry["token_id"])
        return self._token(_token_text_id(entry.get("token")))


class SGLangEngine(RemoteEngine):
    """SGLang's native `/generate`, streamed, with `input_ids` and `return_logprob`.

    `logprobs_mode`: default (SGLang's: after temperature and the top-p cut, renormalized; top-k and
    min-p are not applied to the reported values) or original (the server runs with
    SGLANG_RETURN_ORIGINAL_LOGPROB=1: the model's own distribution).
    """

    kind = "sglang"
    logprobs_modes = ("default", "original")
    constraint_kinds = frozenset({"json_schema", "regex", "grammar"})

    def logprob_mode(self, params: SamplingParams) -> LogprobMode:
        if self.logprobs_mode == "original":
            return logprob_mode(params, scaled=False)
        return logprob_mode(params, scaled=True, truncated_by=("top_p",))

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
        self._check_constraint(constraint)
        mode = self.logprob_mode(params)
        rid = uuid.uuid4().hex
        sampling: dict[str, Any] = {
            **_sampling_fields(prompt, params, self.context_length, length_key="max_new_tokens"),
            "no_stop_trim": True,  # keep the stop token in the output: it was sampled
        }
        if seed is not None:
            sampling["sampling_seed"] = seed % 2**31
        if constraint is not None:  # SGLang's names: json_schema (text), regex, ebnf
            sampling[{"json_schema": "json_schema", "regex": "regex", "grammar": "ebnf"}[constraint.kind]] = (
                constraint.value
            )
        body = {
            "input_ids": _wire_ids(prompt),
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": params.top_logprobs,
            "stream": not whole,
            "rid": rid,
        }
        seen = 0
        finished = False
        events = self._events("/generate", body, session_id, _meta_finished)
        try:
            async for event in events:
                meta = event.get("meta_info")
                if not isinstance(meta, dict):
                    raise EngineProtocolError(f"the engine sent an event without meta_info: {_quote(event)}")
                entries = _list(meta.get("output_token_logprobs"), "output_token_logprobs")
                tops = _list(meta.get("output_top_logprobs"), "output_top_logprobs")
                # cumulative by default (each event repeats what came before); a server with incremental
                # output sends only the new part, which its running completion_tokens tells apart
                total = meta.get("completion_tokens")
                incremental = type(total) is int and len(entries) < total
                new = self._sglang_tokens(entries, tops, 0 if incremental else seen, params, mode)
                for token in new:
                    self.tokens_generated += 1
                    seen += 1
                    yield token
                finished = meta.get("finish_reason") is not None
        finally:
            try:
                await events.aclose()
            finally:  # reached even when a cancelled scope cancels the close above
                if not finished:  # the caller left early or it failed: free the engine's slot now
                    await _run_to_completion(self._abort(rid))

    def _sglang_tokens(
        self, entries: list[Any], tops: list[Any], start: int, params: SamplingParams, mode: LogprobMode
    ) -> list[SampledToken]:
        out = []
        for k in range(start, len(entries)):
            entry = entries[k]
            if not isinstance(entry, list) or len(entry) < 2:
                raise EngineProtocolError(f"the engine sent a logprob entry of an unexpected shape: {_quote(entry)}")
            top = tops[k] if k < len(tops) and tops[k] else []
            if not isinstance(top, list) or not all(isinstance(t, list) and len(t) >= 2 for t in top):
                raise EngineProtocolError(f"the engine sent top logprobs of an unexpected shape: {_quote(top)}")
            alternatives = [(self._token(t[1]), _logprob(t[0])) for t in top]
            out.append(
                SampledToken(
                    self._token(entry[1]), _logprob(entry[0]), _best_first(alternatives, params.top_logprobs), mode
                )
            )
        return out

    async def _abort(self, rid: str) -> None:
        try:
            async with self.control.session().post("/abort_request", json={"rid": rid}) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError):
            return


ENGINE_KINDS: dict[str, type[RemoteEngine]] = {
    "vllm": VLLMEngine,
    "vllm-generate": VLLMGenerateEngine,
    "sglang": SGLangEngine,
}


def make_engine(spec: str) -> RemoteEngine:
    """`KIND=URL[,logprobs-mode=MODE]`, e.g. `vllm=http://10.0.0.5:8000,logprobs-mode=processed_logprobs`."""
    kind, sep, rest = spec.partition("=")
    url, _, option = rest.partition(",")
    name, _, mode = option.partition("=")
    if (
        not sep
        or kind not in ENGINE_KINDS
        or not url.startswith(("http://", "https://"))
        or (option and (name != "logprobs-mode" or not mode))
    ):
        raise InvalidRequest(
            f"engines are given as KIND=URL[,logprobs-mode=MODE] with KIND one of {', '.join(ENGINE_KINDS)}",
            param="engine",
        )
    return ENGINE_KINDS[kind](url, logprobs_mode=mode or None)

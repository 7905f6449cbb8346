"""What clients really received, read off the wire, compared with the session export.

`RecordingTransport` sits under a client library's own HTTP client (httpx2, which the openai and
anthropic SDKs use, or httpx) and keeps every response body as it streamed by, so a test can check
the token data of every call a framework made without reaching into the framework.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import httpx2


@dataclass
class Exchange:
    path: str
    status: int
    body: bytearray = field(default_factory=bytearray)

    def events(self) -> list[dict[str, Any]]:
        """The JSON payloads of a server-sent event stream."""
        out = []
        for line in self.body.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: ") :]))
        return out

    @property
    def streamed(self) -> bool:
        return self.body.lstrip().startswith((b"data:", b"event:"))

    def json(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(bytes(self.body))
        return value


@dataclass(frozen=True)
class Turn:
    """One sampled turn as a client saw it: the prompt, the sampled tokens, their logprobs (None
    when the call did not ask for them)."""

    prompt: list[int]
    sampled: list[int]
    logprobs: list[float] | None


class _Teeing:
    """A response body that copies each chunk into the record as the client reads it."""

    def __init__(self, stream: Any, record: Exchange) -> None:
        self.stream, self.record = stream, record

    async def __aiter__(self) -> Any:
        async for chunk in self.stream:
            self.record.body += chunk
            yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Tee2(_Teeing, httpx2.AsyncByteStream):
    """For the openai SDK's HTTP client (httpx2)."""


class _Tee(_Teeing, httpx.AsyncByteStream):
    """For httpx clients."""


class RecordingTransport(httpx2.AsyncBaseTransport):
    def __init__(self) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.exchanges: list[Exchange] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        record = Exchange(request.url.path, response.status_code)
        self.exchanges.append(record)
        stream = _Tee2(response.stream, record)
        return httpx2.Response(
            response.status_code, headers=response.headers, stream=stream, extensions=response.extensions
        )

    async def aclose(self) -> None:
        await self.inner.aclose()

    def client(self, **kwargs: Any) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(transport=self, timeout=120.0, **kwargs)

    def turns(self) -> list[Turn]:
        """Every sampled turn of every successful call, whatever its dialect."""
        return [turn for exchange in self.exchanges if exchange.status == 200 for turn in turns_of(exchange)]


class RecordingHttpxTransport(httpx.AsyncBaseTransport):
    """The same for clients that take an `httpx` client (langchain-openai)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.exchanges: list[Exchange] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        record = Exchange(request.url.path, response.status_code)
        self.exchanges.append(record)
        stream = _Tee(response.stream, record)
        return httpx.Response(
            response.status_code, headers=response.headers, stream=stream, extensions=response.extensions
        )

    def turns(self) -> list[Turn]:
        return [turn for exchange in self.exchanges if exchange.status == 200 for turn in turns_of(exchange)]


def _chat_logprobs(logprobs: Any) -> list[float] | None:
    if not logprobs or logprobs.get("content") is None:
        return None
    return [entry["logprob"] for entry in logprobs["content"]]


def turns_of(exchange: Exchange) -> list[Turn]:
    path = exchange.path
    if path.endswith("/chat/completions") or path.endswith("/inference/v1/generate"):
        if not exchange.streamed:
            body = exchange.json()
            return [
                Turn(body["prompt_token_ids"], c["token_ids"], _chat_logprobs(c.get("logprobs")))
                for c in body["choices"]
            ]
        prompt: list[int] = []
        sampled: dict[int, list[int]] = {}
        logprobs: dict[int, list[float] | None] = {}
        for event in exchange.events():
            prompt = event.get("prompt_token_ids") or prompt
            for choice in event.get("choices", []):
                sampled.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
                values = _chat_logprobs(choice.get("logprobs"))
                if values is not None:
                    logprobs[choice["index"]] = (logprobs.get(choice["index"]) or []) + values
        return [Turn(prompt, tokens, logprobs.get(i)) for i, tokens in sorted(sampled.items())]
    if path.endswith("/responses"):
        body = (
            exchange.json() if not exchange.streamed else _last(exchange, ("response.completed", "response.incomplete"))
        )
        values = [e["logprob"] for e in body["output_logprobs"]] if "output_logprobs" in body else None
        return [Turn(body["prompt_token_ids"], body["token_ids"], values)]
    if path.endswith("/messages"):
        if not exchange.streamed:
            body = exchange.json()
            values = [e["logprob"] for e in body["logprobs"]] if "logprobs" in body else None
            return [Turn(body["prompt_token_ids"], body["token_ids"], values)]
        events = exchange.events()
        start = next(e for e in events if e["type"] == "message_start")["message"]
        delta = next(e for e in events if e["type"] == "message_delta")
        values = [e["logprob"] for e in delta["logprobs"]] if "logprobs" in delta else None
        return [Turn(start["prompt_token_ids"], delta["token_ids"], values)]
    return []


def _last(exchange: Exchange, kinds: tuple[str, ...]) -> dict[str, Any]:
    response: dict[str, Any] = next(e for e in reversed(exchange.events()) if e.get("type") in kinds)["response"]
    return response


def assert_on_tape(export: dict[str, Any], turns: list[Turn]) -> None:
    """Every turn a client received is on a branch of the export, token for token: its prompt is the
    branch up to there, its sampled tokens follow with loss mask 1 and the same logprobs."""
    assert turns, "no sampled turn was recorded on the wire"
    for turn in turns:
        start, end = len(turn.prompt), len(turn.prompt) + len(turn.sampled)
        matches = [
            branch
            for branch in export["branches"]
            if branch["tokens"][:end] == turn.prompt + turn.sampled
            and all(branch["loss_mask"][start:end])
            and not any(branch["loss_mask"][end : end + 1])  # the whole turn: what follows is not sampled
            and not any(branch["loss_mask"][start - 1 : start])  # and it starts where sampling started
        ]
        assert matches, f"a turn of {len(turn.sampled)} sampled tokens is on no branch of the export"
        if turn.logprobs is not None:
            assert any(branch["logprobs"][start:end] == turn.logprobs for branch in matches)

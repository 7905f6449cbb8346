"""Local stand-ins for vLLM and SGLang servers, speaking their documented wire formats (field names,
SSE framing, finish reasons, error bodies), for adapter and routing tests. A test instrument: the
tokens are a deterministic script, not a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

END_OF_TURN = 2  # SmolLM2's <|im_end|>: the fakes speak the embedded tokenizer's vocabulary
CONTEXT = 4096
MISSING = "Internal server error"  # vLLM's whole answer to an image named by a hash it does not hold


def script(
    prompt: list[int], seed: int | None, length: int = 12, end_of_turn: int = END_OF_TURN, salt: object = None
) -> list[tuple[int, float]]:
    """The tokens a fake engine 'samples' for a prompt: deterministic, spread over the vocabulary.
    `salt`: what else the engine saw (e.g. its images' hashes)."""
    digest = hashlib.sha256(json.dumps([prompt[-32:], len(prompt), seed, salt]).encode()).digest()
    tokens = [
        (300 + int.from_bytes(digest[2 * i : 2 * i + 2], "big") % 30000, -((digest[i] % 97) / 50.0 + 0.01))
        for i in range(length)
    ]
    return [*tokens, (end_of_turn, -0.05)]


@dataclass
class FakeState:
    requests: list[dict[str, Any]] = field(default_factory=list)
    session_headers: list[str | None] = field(default_factory=list)
    aborted: int = 0
    fail_next: int = 0  # answer 500 to this many generation requests
    delay: float = 0.0  # seconds per token
    healthy: bool = True
    peers: set[int] = field(default_factory=set)  # client ports seen: one per TCP connection opened to it
    # fault injection: rewrites the streamed event at each index into the bytes sent after `data: `
    mangle: Callable[[int, dict[str, Any]], bytes] | None = None
    end_of_turn: int = END_OF_TURN  # the token that ends each scripted answer (the model's <|im_end|>)
    # images (tests/support/fake_vision.py): vLLM's render route, and the check of a generate request's
    # `features` (an error message, or None when they fit the prompt)
    render: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    check_features: Callable[[dict[str, Any]], str | None] | None = None
    queued: list[list[int]] = field(default_factory=list)  # answers to give next, exactly (logprob -0.5)
    token_ids_unasked: bool = False  # a vLLM-like server that sends `token_ids` even when not asked
    record: bool = True  # keep what was sent (`requests`, `session_headers`); off for long benchmarks
    burst: bool = False  # a stream's events (and its end) in one write, as a gateway reads them when behind
    before_event: Callable[[int], Awaitable[None]] | None = None  # awaited before each streamed event after the first


def _take(
    prompt: list[int],
    max_tokens: int,
    stops: list[int],
    seed: int | None,
    state: FakeState | None = None,
    salt: object = None,
) -> tuple[list[tuple[int, float]], str]:
    tokens = []
    end = END_OF_TURN if state is None else state.end_of_turn
    if state is not None and state.queued:
        answer = [(token, -0.5) for token in state.queued.pop(0)]
    else:
        answer = script(prompt, seed, end_of_turn=end, salt=salt)
    for token, logprob in answer:
        if len(tokens) == max_tokens:
            return tokens, "length"
        tokens.append((token, logprob))
        if token == end or token in stops:
            return tokens, "stop"
    return tokens, "stop"


async def _received(state: FakeState, request: Request) -> dict[str, Any]:
    body: dict[str, Any] = await request.json()
    if state.record:
        state.requests.append(body)
        state.session_headers.append(request.headers.get("x-session-id"))
    if request.client is not None:
        state.peers.add(request.client.port)
    return body


def _fails(state: FakeState) -> bool:
    """Whether this request is one of the `fail_next` the test asked for."""
    if not state.fail_next:
        return False
    state.fail_next -= 1
    return True


def _common_routes(state: FakeState) -> list[Route]:
    """`/health` (503 once the test marks the engine unhealthy) and `/v1/models`, as both servers have."""

    async def health(_: Request) -> Response:
        return Response(status_code=200 if state.healthy else 503)

    async def models(_: Request) -> JSONResponse:
        return JSONResponse(
            {"object": "list", "data": [{"id": "fake-model", "object": "model", "max_model_len": CONTEXT}]}
        )

    return [Route("/health", health), Route("/v1/models", models)]


async def _gone(_: Request, __: Exception) -> Response:
    return Response(status_code=499)  # the gateway left before its request arrived: nothing to answer


EXCEPTION_HANDLERS = {ClientDisconnect: _gone}


def _error(status: int, message: str) -> JSONResponse:
    # vLLM's error body (its OpenAI server): {"object": "error", "message", "type", "param", "code"}
    return JSONResponse(
        {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status},
        status_code=status,
    )


def alternatives(token: int, logprob: float, k: int) -> list[tuple[int, float]]:
    """The `k` most likely tokens at a position where `token` was sampled with `logprob`: tokens the
    script did not pick share the rest of the mass, halving at each rank (so the sampled token is not
    always the most likely). Best first."""
    rest = 1.0 - math.exp(logprob)
    others = [((token + 7 * r) % 30000 + 300, math.log(rest / 2**r)) for r in range(1, k + 1)]
    return sorted([*others, (token, logprob)], key=lambda pair: -pair[1])[:k]


def vllm_top(token: int, logprob: float, k: int) -> list[tuple[int, float]]:
    """vLLM's order: the sampled token first, then the top `k` (the sampled one again only if it is among them)."""
    return [(token, logprob), *[(t, lp) for t, lp in alternatives(token, logprob, k) if t != token]]


def vllm_app(state: FakeState) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await _received(state, request)
        if _fails(state):
            return _error(500, "engine core died")
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return _error(400, "prompt must be token IDs in this test")
        if len(prompt) + body.get("max_tokens", 16) > CONTEXT:
            return _error(400, f"This model's maximum context length is {CONTEXT} tokens.")
        tokens, finish = _take(prompt, body.get("max_tokens", 16), body.get("stop_token_ids") or [], body.get("seed"))
        top = body.get("logprobs")

        def choice(token: int, logprob: float, last: bool) -> dict[str, Any]:
            return {
                "index": 0,
                "text": f"<{token}>",
                "logprobs": {
                    "text_offset": [0],
                    "token_logprobs": [logprob],
                    "tokens": [f"token_id:{token}"],
                    "top_logprobs": [{f"token_id:{t}": lp for t, lp in vllm_top(token, logprob, top)}]
                    if top is not None
                    else None,
                },
                "finish_reason": finish if last else None,
                "stop_reason": (token if finish == "stop" else None) if last else None,
                # as vLLM: token IDs (and the prompt's, echoed) only when asked for
                **({"token_ids": [token]} if body.get("return_token_ids") or state.token_ids_unasked else {}),
            }

        def answer(choices: list[dict[str, Any]]) -> dict[str, Any]:
            head = {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()), "model": "fake-model"}
            return {**head, "choices": choices}

        def chunk(i: int, token: int, logprob: float) -> dict[str, Any]:
            return answer([choice(token, logprob, i == len(tokens) - 1)])

        if not body.get("stream"):
            whole = answer([_merged([choice(t, lp, i == len(tokens) - 1) for i, (t, lp) in enumerate(tokens)])])
            return await _whole(state, request, whole, len(tokens))
        return _stream(state, [chunk(i, t, lp) for i, (t, lp) in enumerate(tokens)])

    async def generate(request: Request) -> Response:
        # vLLM 0.32's token endpoint: logprobs.content[j] = {token_id, logprob, rank, top_logprobs}
        body = await _received(state, request)
        if _fails(state):
            return _error(500, "engine core died")
        params = body["sampling_params"]
        salt = None
        if body.get("features") is not None or state.check_features is not None:
            problem = state.check_features(body) if state.check_features else "this engine takes no images"
            if problem is MISSING:  # as vLLM 0.32 answers an image its cache does not hold
                error = {"message": MISSING, "type": "InternalServerError", "param": None, "code": 500}
                return _stream(state, [{"error": error}]) if body.get("stream") else _error(500, MISSING)
            if problem is not None:
                return _error(400, problem)
            salt = (body.get("features") or {}).get("mm_hashes")
        tokens, finish = _take(
            body["token_ids"],
            params.get("max_tokens", 16),
            params.get("stop_token_ids") or [],
            params.get("seed"),
            state,
            salt,
        )
        k = params.get("logprobs") or 0

        def entry(t: int, lp: float) -> dict[str, Any]:
            ranked = alternatives(t, lp, 20)
            rank = next((r + 1 for r, (other, _) in enumerate(ranked) if other == t), 21)
            return {
                "token_id": t,
                "logprob": lp,
                "rank": rank,
                "top_logprobs": [{"token_id": a, "logprob": alp} for a, alp in vllm_top(t, lp, k)],
            }

        def choice(delta: list[tuple[int, float]], last: bool) -> dict[str, Any]:
            return {
                "index": 0,
                "token_ids": [t for t, _ in delta],
                "logprobs": {"content": [entry(t, lp) for t, lp in delta]},
                "finish_reason": finish if last else None,
            }

        if body.get("stream"):
            events = [
                {"request_id": "gen-fake", "choices": [choice([pair], i == len(tokens) - 1)]}
                for i, pair in enumerate(tokens)
            ]
            return _stream(state, events)
        whole = {
            "request_id": "gen-fake",
            "choices": [choice(tokens, True)],
            "usage": {"prompt_tokens": len(body["token_ids"]), "completion_tokens": len(tokens)},
        }
        return await _whole(state, request, whole, len(tokens))

    async def render(request: Request) -> Response:
        body = await request.json()
        if state.render is None:
            return _error(404, "Not Found")
        return JSONResponse(state.render(body))

    return Starlette(
        exception_handlers=EXCEPTION_HANDLERS,
        routes=[
            *_common_routes(state),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/inference/v1/generate", generate, methods=["POST"]),
            Route("/v1/chat/completions/render", render, methods=["POST"]),
        ],
    )


def _merged(choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One completions choice holding the tokens of per-token choices, as vLLM answers unstreamed."""
    logprobs = [c["logprobs"] for c in choices]
    tops = [top for lp in logprobs for top in (lp["top_logprobs"] or [])]
    return {
        **choices[-1],
        "text": "".join(c["text"] for c in choices),
        **({"token_ids": [t for c in choices for t in c["token_ids"]]} if "token_ids" in choices[-1] else {}),
        "logprobs": {
            "text_offset": [0] * len(choices),
            "token_logprobs": [v for lp in logprobs for v in lp["token_logprobs"]],
            "tokens": [t for lp in logprobs for t in lp["tokens"]],
            "top_logprobs": tops or None,
        },
    }


async def _whole(
    state: FakeState, request: Request, payload: dict[str, Any], tokens: int, *, disconnect_aborts: bool = True
) -> Response:
    """An unstreamed answer, after `state.delay` per token. vLLM aborts a request whose client went
    away meanwhile (`disconnect_aborts`); SGLang waits for `/abort_request`."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(asyncio.sleep(state.delay * tokens))
    watch = asyncio.ensure_future(gone())
    await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    work.cancel()
    watch.cancel()
    if watch.done() and not watch.cancelled():
        if disconnect_aborts:
            state.aborted += 1
        return Response(status_code=499)
    data = state.mangle(0, payload) if state.mangle else json.dumps(payload).encode()
    return Response(data, media_type="application/json")


def _stream(state: FakeState, events: list[dict[str, Any]], *, disconnect_aborts: bool = True) -> StreamingResponse:
    """Server-sent events, one per token, `state.delay` apart, then `[DONE]`. vLLM aborts a request whose
    client went away (`disconnect_aborts`); SGLang waits for `/abort_request`."""

    async def lines() -> AsyncIterator[bytes]:
        try:
            if state.burst:
                data = [state.mangle(i, e) if state.mangle else json.dumps(e).encode() for i, e in enumerate(events)]
                yield b"".join(b"data: " + d + b"\n\n" for d in data) + b"data: [DONE]\n\n"
                return
            for i, event in enumerate(events):
                await asyncio.sleep(state.delay)
                if i and state.before_event is not None:
                    await state.before_event(i)
                data = state.mangle(i, event) if state.mangle else json.dumps(event).encode()
                yield b"data: " + data + b"\n\n"
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            if disconnect_aborts:
                state.aborted += 1
            raise

    return StreamingResponse(lines(), media_type="text/event-stream")


def sglang_app(state: FakeState) -> Starlette:
    async def abort(request: Request) -> JSONResponse:
        state.aborted += 1
        return JSONResponse({})

    async def generate(request: Request) -> Response:
        body = await _received(state, request)
        if _fails(state):
            return JSONResponse({"error": {"message": "scheduler died"}}, status_code=500)
        params = body["sampling_params"]
        tokens, finish = _take(
            body["input_ids"],
            params.get("max_new_tokens", 16),
            params.get("stop_token_ids") or [],
            params.get("sampling_seed"),
        )

        def chunk(i: int) -> dict[str, Any]:
            done = i == len(tokens)
            reason = None
            if done:
                reason = (
                    {"type": "stop", "matched": tokens[-1][0]}
                    if finish == "stop"
                    else {"type": "length", "length": len(tokens)}
                )
            k = body.get("top_logprobs_num") or 0
            tops = [[[alp, a, None] for a, alp in alternatives(t, lp, k)] for t, lp in tokens[:i]]
            return {
                "text": "".join(f"<{t}>" for t, _ in tokens[:i]),
                "output_ids": [t for t, _ in tokens[:i]],
                "meta_info": {
                    "id": body.get("rid"),
                    "finish_reason": reason,
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": i,
                    "output_token_logprobs": [[lp, t, None] for t, lp in tokens[:i]],
                    "output_top_logprobs": tops if k else None,
                },
            }

        if not body.get("stream"):
            return await _whole(state, request, chunk(len(tokens)), len(tokens), disconnect_aborts=False)
        # SGLang streams cumulative output: each event repeats what came before
        return _stream(state, [chunk(i) for i in range(1, len(tokens) + 1)], disconnect_aborts=False)

    return Starlette(
        exception_handlers=EXCEPTION_HANDLERS,
        routes=[
            *_common_routes(state),
            Route("/generate", generate, methods=["POST"]),
            Route("/abort_request", abort, methods=["POST"]),
        ],
    )


class SwappableApp:
    """An ASGI app handing each request to the app set last. A module keeps one uvicorn server per
    stand-in (starting and stopping one costs more than most tests that use it) while each test sets
    a fresh app on a fresh state, so a request still running from an earlier test reaches only that
    test's app."""

    def __init__(self) -> None:
        self.app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


@contextlib.contextmanager
def serving(app: Starlette | SwappableApp, host: str = "127.0.0.1", **options: Any) -> Iterator[str]:
    """Run an ASGI app with uvicorn in a thread on a free loopback port (any of 127/8 on Linux);
    `options`: more of uvicorn's settings."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)

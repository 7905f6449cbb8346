"""Local stand-ins for vLLM and SGLang servers, speaking their documented wire formats (field names,
SSE framing, finish reasons, error bodies), for adapter and routing tests. A test instrument: the
tokens are a deterministic script, not a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

END_OF_TURN = 2  # SmolLM2's <|im_end|>: the fakes speak the embedded tokenizer's vocabulary
CONTEXT = 4096


def script(prompt: list[int], seed: int | None, length: int = 12) -> list[tuple[int, float]]:
    """The tokens a fake engine 'samples' for a prompt: deterministic, spread over the vocabulary."""
    digest = hashlib.sha256(json.dumps([prompt[-32:], len(prompt), seed]).encode()).digest()
    tokens = [
        (300 + int.from_bytes(digest[2 * i : 2 * i + 2], "big") % 30000, -((digest[i] % 97) / 50.0 + 0.01))
        for i in range(length)
    ]
    return [*tokens, (END_OF_TURN, -0.05)]


@dataclass
class FakeState:
    requests: list[dict[str, Any]] = field(default_factory=list)
    session_headers: list[str | None] = field(default_factory=list)
    aborted: int = 0
    fail_next: int = 0  # answer 500 to this many generation requests
    delay: float = 0.0  # seconds per token
    healthy: bool = True


def _take(
    prompt: list[int], max_tokens: int, stops: list[int], seed: int | None
) -> tuple[list[tuple[int, float]], str]:
    tokens = []
    for token, logprob in script(prompt, seed):
        if len(tokens) == max_tokens:
            return tokens, "length"
        tokens.append((token, logprob))
        if token == END_OF_TURN or token in stops:
            return tokens, "stop"
    return tokens, "stop"


async def _received(state: FakeState, request: Request) -> dict[str, Any]:
    body: dict[str, Any] = await request.json()
    state.requests.append(body)
    state.session_headers.append(request.headers.get("x-session-id"))
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


def _error(status: int, message: str) -> JSONResponse:
    # vLLM's error body (its OpenAI server): {"object": "error", "message", "type", "param", "code"}
    return JSONResponse(
        {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status},
        status_code=status,
    )


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
                    "top_logprobs": [{f"token_id:{token}": logprob}] if top else None,
                },
                "finish_reason": finish if last else None,
                "stop_reason": (token if finish == "stop" else None) if last else None,
                "token_ids": [token],
            }

        async def events() -> AsyncIterator[bytes]:
            try:
                for i, (token, logprob) in enumerate(tokens):
                    await asyncio.sleep(state.delay)
                    chunk = {
                        "id": "cmpl-fake",
                        "object": "text_completion",
                        "created": int(time.time()),
                        "model": "fake-model",
                        "choices": [choice(token, logprob, i == len(tokens) - 1)],
                    }
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                state.aborted += 1
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    async def generate(request: Request) -> Response:
        body = await _received(state, request)
        if _fails(state):
            return _error(500, "engine core died")
        params = body["sampling_params"]
        tokens, finish = _take(
            body["token_ids"],
            params.get("max_tokens", 16),
            params.get("stop_token_ids") or [],
            params.get("seed"),
        )
        content = [
            {
                "token": f"token_id:{t}",
                "logprob": lp,
                "bytes": None,
                "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp}],
            }
            for t, lp in tokens
        ]
        return JSONResponse(
            {
                "request_id": "gen-fake",
                "choices": [
                    {
                        "index": 0,
                        "token_ids": [t for t, _ in tokens],
                        "logprobs": {"content": content},
                        "finish_reason": finish,
                    }
                ],
                "usage": {"prompt_tokens": len(body["token_ids"]), "completion_tokens": len(tokens)},
            }
        )

    return Starlette(
        routes=[
            *_common_routes(state),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/inference/v1/generate", generate, methods=["POST"]),
        ]
    )


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

        async def events() -> AsyncIterator[bytes]:
            for i in range(1, len(tokens) + 1):
                await asyncio.sleep(state.delay)
                done = i == len(tokens)
                reason = None
                if done:
                    reason = (
                        {"type": "stop", "matched": tokens[-1][0]}
                        if finish == "stop"
                        else {"type": "length", "length": len(tokens)}
                    )
                chunk = {
                    "text": "".join(f"<{t}>" for t, _ in tokens[:i]),
                    "output_ids": [t for t, _ in tokens[:i]],
                    "meta_info": {
                        "id": body.get("rid"),
                        "finish_reason": reason,
                        "prompt_tokens": len(body["input_ids"]),
                        "completion_tokens": i,
                        "output_token_logprobs": [[lp, t, None] for t, lp in tokens[:i]],
                    },
                }
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            *_common_routes(state),
            Route("/generate", generate, methods=["POST"]),
            Route("/abort_request", abort, methods=["POST"]),
        ]
    )


@contextlib.contextmanager
def serving(app: Starlette) -> Iterator[str]:
    """Run an ASGI app with uvicorn in a thread on a free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)

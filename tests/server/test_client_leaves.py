"""A client that leaves, on every generation route, at every point it can: before the first token,
mid-generation, after the last token before the answer is sent; streamed and not. Nothing is logged
as an error (no traceback, no `unexpected error`), nobody is sent an answer after the client left a
whole answer, and the turn is recorded as it is on the chat route: aborted with what was sampled, or
whole when the last token came before the client left.

Driven at the ASGI level: the app reads the body, then `receive` answers `http.disconnect` at the
moment the test chooses, which the engine below marks (before its first token, after its second,
after its last)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, MutableMapping, Sequence
from typing import Any

import orjson
import pytest

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken
from tokentape.errors import NotFound
from tokentape.render.renderer import Renderer

WAIT = 10.0  # seconds: far more than any of these takes
SAMPLED = [300, 301, 302, 303]  # then the end of the turn

ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}),
    "completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 8}),
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 8}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}),
    "generate": ("/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8}}),
}
POINTS = ("before_first_token", "mid_generation", "after_last_token")


class LeavingEngine:
    """Answers SAMPLED then the end of the turn, and sets `leave` at the chosen point: before its
    first token (then it waits), after its second token (then it waits), or after its last one."""

    def __init__(self, end_of_turn: int) -> None:
        self.end_of_turn = end_of_turn
        self.model_id = "leaving"
        self.context_length = 4096
        self.point = ""
        self.leave = asyncio.Event()

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
        tokens = [*SAMPLED, self.end_of_turn]
        if self.point == "before_first_token":
            self.leave.set()
            await asyncio.sleep(WAIT)  # the client goes meanwhile
        for index, token in enumerate(tokens):
            yield SampledToken(token, -1.0)
            if index == 1 and self.point == "mid_generation":
                self.leave.set()
                await asyncio.sleep(WAIT)
        if self.point == "after_last_token":
            self.leave.set()

    def describe(self) -> dict[str, Any]:
        return {"kind": "leaving", "model": self.model_id}

    async def close(self) -> None:
        return None


class Client:
    """ASGI's receive and send for one request: the body, then a disconnect once `leave` is set."""

    def __init__(self, body: bytes, leave: asyncio.Event) -> None:
        self.body, self.leave = body, leave
        self.read = False
        self.sent: list[MutableMapping[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"t")],
        "client": ("127.0.0.1", 5000),
        "server": ("t", 80),
    }


async def _leave(renderer: Renderer, route: str, point: str, stream: bool) -> tuple[Client, list[Any] | None]:
    """One request whose client leaves at `point`; what was sent to it and the session's turns."""
    engine = LeavingEngine(renderer.tokenizer.encode("<|im_end|>")[0])
    engine.point = point
    built = build(engine, renderer)  # type: ignore[arg-type]
    app, registry = built.app, built.gateway.sessions
    path, fields = ROUTES[route]
    body = orjson.dumps({"model": MODEL_NAME, **fields, "stream": stream})
    client = Client(body, engine.leave)
    await asyncio.wait_for(app(_scope(f"/sessions/left/{path.lstrip('/')}"), client.receive, client.send), WAIT)
    try:
        session = await registry.get("left")
    except NotFound:  # nothing sampled: no session is kept
        turns = None
    else:
        turns = [(node.sampled, node.finish_reason) for node in session.tree.nodes]
    await registry.aclose()
    return client, turns


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_client_that_leaves_is_no_error_and_its_turn_is_recorded(
    renderer: Renderer, caplog: pytest.LogCaptureFixture, route: str, point: str, stream: bool
) -> None:
    caplog.set_level(logging.WARNING)
    client, turns = await _leave(renderer, route, point, stream)
    problems = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info or "unexpected" in r.message]
    assert not problems, [f"{r.name}: {r.getMessage()}" for r in problems]
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    if point == "mid_generation":
        assert turns == [((300, 301), "abort")]  # what was sampled, kept
    elif point == "after_last_token":
        assert turns == [((*SAMPLED, end), "stop")]
    else:
        assert turns is None
    if not stream and point != "after_last_token":  # nobody to read a whole answer: none is made
        bodies = b"".join(m.get("body", b"") for m in client.sent if m["type"] == "http.response.body")
        assert bodies == b""


@pytest.mark.parametrize("point", POINTS)
async def test_every_route_records_what_the_chat_route_records(renderer: Renderer, point: str) -> None:
    for stream in (False, True):
        _, expected = await _leave(renderer, "chat", point, stream)
        for route in ROUTES:
            _, turns = await _leave(renderer, route, point, stream)
            assert turns == expected, (route, stream)

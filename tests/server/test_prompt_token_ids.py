"""`--prompt-token-ids asked`: a response carries the prompt's token IDs only when its request asks with
vLLM's `return_token_ids: true`, in every dialect that carries them, streamed or not; the tape (and
so the export) holds the same tokens either way, and usage still counts them. Under the default,
`always`, every response carries them as before. A scripted engine answers: the case is the shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.engines.remote.wire import wire_ids
from tokentape.engines.scripted import ScriptedEngine
from tokentape.gateway.service import Gateway
from tokentape.render.renderer import Renderer

HI = [{"role": "user", "content": "Name three colours."}]
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 6},
    "/v1/completions": {"prompt": "Three colours:", "max_tokens": 6},
    "/v1/responses": {"input": "Name three colours.", "max_output_tokens": 6},
    "/v1/messages": {"messages": HI, "max_tokens": 6},
}


async def _client(renderer: Renderer, mode: str) -> tuple[Gateway, httpx.AsyncClient]:
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    built = build(ScriptedEngine(renderer.tokenizer.encode(" Red, green, blue."), end), renderer, prompt_token_ids=mode)
    gateway, app = built.gateway, built.app
    return gateway, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.fixture
async def asked(renderer: Renderer) -> AsyncIterator[httpx.AsyncClient]:
    gateway, client = await _client(renderer, "asked")
    async with client:
        yield client
    await gateway.aclose()


@pytest.fixture
async def always(renderer: Renderer) -> AsyncIterator[httpx.AsyncClient]:
    gateway, client = await _client(renderer, "always")
    async with client:
        yield client
    await gateway.aclose()


def _events(body: bytes) -> list[dict[str, Any]]:
    """Every JSON event of an SSE stream (OpenAI's `data:` lines and Anthropic's)."""
    lines = [line[len(b"data: ") :] for line in body.splitlines() if line.startswith(b"data: ")]
    return [orjson.loads(line) for line in lines if line != b"[DONE]"]


def _prompt_ids_anywhere(value: object) -> list[list[int]]:
    """Every `prompt_token_ids` in a response or event, at any depth (chat's top level, a completions
    choice, Anthropic's `message_start`, Responses' `response`)."""
    found: list[list[int]] = []
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "prompt_token_ids":
                found.append(inner)
            else:
                found += _prompt_ids_anywhere(inner)
    elif isinstance(value, list):
        for inner in value:
            found += _prompt_ids_anywhere(inner)
    return found


async def _exported_prompt(client: httpx.AsyncClient, session: str) -> list[int]:
    """The tokens before the first sampled one, from the tape (not from any response)."""
    (branch,) = (await client.get(f"/sessions/{session}/export")).json()["branches"]
    return branch["tokens"][: branch["loss_mask"].index(1)]


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("stream", [False, True])
async def test_asked_mode_sends_the_prompt_only_to_a_request_that_asks(
    asked: httpx.AsyncClient, route: str, stream: bool
) -> None:
    body = {"model": MODEL_NAME, **ROUTES[route], "stream": stream}
    tag = f"{route.rsplit('/', 1)[-1]}-{stream}"
    plain = await asked.post(f"/sessions/plain-{tag}/v1{route[3:]}", json=body)
    wanted = await asked.post(f"/sessions/wanted-{tag}/v1{route[3:]}", json={**body, "return_token_ids": True})
    assert plain.status_code == wanted.status_code == 200, (plain.text, wanted.text)
    events_plain = _events(plain.content) if stream else [plain.json()]
    events_wanted = _events(wanted.content) if stream else [wanted.json()]
    assert _prompt_ids_anywhere(events_plain) == []
    shown = _prompt_ids_anywhere(events_wanted)
    assert shown, "a request that asks gets the prompt's token IDs"
    recorded = await _exported_prompt(asked, f"wanted-{tag}")
    assert all(ids == recorded for ids in shown)
    assert await _exported_prompt(asked, f"plain-{tag}") == recorded  # the tape holds them either way
    if not stream and route != "/v1/completions":  # usage counts the prompt whether or not it is shown
        usage = plain.json()["usage"]
        assert usage.get("prompt_tokens", usage.get("input_tokens")) == len(recorded)


@pytest.mark.parametrize("route", list(ROUTES))
async def test_by_default_every_response_carries_the_prompt(always: httpx.AsyncClient, route: str) -> None:
    session = f"always-{route.rsplit('/', 1)[-1]}"
    reply = await always.post(f"/sessions/{session}/v1{route[3:]}", json={"model": MODEL_NAME, **ROUTES[route]})
    assert reply.status_code == 200, reply.text
    assert _prompt_ids_anywhere(reply.json()) == [await _exported_prompt(always, session)] * (
        2 if route == "/v1/completions" else 1  # completions: at the top level and in its choice
    )


@pytest.mark.parametrize("value", ["yes", 1, [True]])
async def test_a_return_token_ids_that_is_no_boolean_is_a_400_naming_it(
    asked: httpx.AsyncClient, value: object
) -> None:
    body = {"model": MODEL_NAME, **ROUTES["/v1/chat/completions"], "return_token_ids": value}
    reply = await asked.post("/sessions/bad/v1/chat/completions", json=body)
    assert reply.status_code == 400
    assert "return_token_ids" in reply.text
    exported = await asked.get("/sessions/bad/export")
    assert exported.status_code == 404 or exported.json()["branches"] == []  # nothing was recorded


class _Recording(ScriptedEngine):
    """Writes each prompt's IDs as a remote engine's body does (`wire_ids`), and remembers both the IDs
    it was handed and what the text says."""

    def __init__(self, script: list[int], end_of_turn: int) -> None:
        super().__init__(script, end_of_turn)
        self.prompts: list[list[int]] = []
        self.texts: list[list[int]] = []

    def generate(self, prompt: Any, params: Any, **options: Any) -> Any:
        self.prompts.append(list(prompt))
        self.texts.append(orjson.loads(orjson.dumps(wire_ids(prompt, to_engine=True))))
        return super().generate(prompt, params, **options)


async def test_each_later_prompts_text_is_its_ids_across_extensions_and_a_branch(renderer: Renderer) -> None:
    """A later prompt's text for the engine is written from the session's previous one (`PathTextSlot`):
    along one path, then back on an earlier turn after the path grew past it, with new messages long
    enough to outrun what the path gained since."""
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = _Recording(renderer.tokenizer.encode(" Red, green, blue."), end)
    built = build(engine, renderer, prompt_token_ids="always")
    gateway, app = built.gateway, built.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        history: list[dict[str, Any]] = []
        shown: list[list[int]] = []
        for user in ("Name three colours.", "And three more?", "Which is warmest?"):
            history.append({"role": "user", "content": user})
            body = {"model": MODEL_NAME, "messages": history, "max_tokens": 8}
            answer = (await client.post("/sessions/p/v1/chat/completions", json=body)).json()
            shown += _prompt_ids_anywhere(answer)
            if len(shown) == 1:  # the first prompt's text is the session's from its turn on (`hand_on`)
                session = gateway.sessions.in_memory("p")
                assert session is not None and session.tree.prompt_text.held_bytes == len(orjson.dumps(shown[0]))
            history.append(answer["choices"][0]["message"])
        branch = [*history[:2], {"role": "user", "content": "Tell me about mauve. " * 40}]
        body = {"model": MODEL_NAME, "messages": branch, "max_tokens": 8}
        shown += _prompt_ids_anywhere((await client.post("/sessions/p/v1/chat/completions", json=body)).json())
    await gateway.aclose()
    assert engine.texts == engine.prompts
    assert shown == engine.prompts
    assert len(shown[3]) > len(shown[2]) + 8  # it outran the path's tokens after the turn it branched from

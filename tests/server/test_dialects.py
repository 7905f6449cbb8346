"""The Responses and Anthropic Messages translations: input items and content blocks to chat
messages, stream events that validate as the openai and anthropic packages' own event types, and
bad input answered in each dialect's error shape without touching any session."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pydantic
import pytest

from tests.conftest import MODEL_NAME
from tests.support.sdk_shapes import check_anthropic_event, check_message, check_response, check_responses_event
from tests.support.served import build
from tokentape.core.sampling import SamplingParams
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.server.dialects import (
    anthropic_input,
    responses_history,
    responses_input,
)
from tokentape.server.dialects.responses_input import LOGPROBS_INCLUDE


def _events(body: str) -> list[tuple[str, dict[str, Any]]]:
    out, name = [], ""
    for line in body.splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[len("data: ") :])))
    return out


async def test_responses_stream_events_are_the_sdks_types(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", "stream": True, "max_output_tokens": 8, "temperature": 0}
    response = await http.post("/v1/responses", json=body)
    assert response.status_code == 200
    events = _events(response.text)
    for name, event in events:
        check_responses_event(event)
        assert name == event["type"]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    kinds = [e["type"] for _, e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1][1]["response"]
    streamed = "".join(e["delta"] for _, e in events if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == streamed


async def test_anthropic_stream_events_are_the_sdks_types(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    response = await http.post("/v1/messages", json=body)
    assert response.status_code == 200
    events = _events(response.text)
    for name, event in events:
        check_anthropic_event(event)
        assert name == event["type"]
    kinds = [e["type"] for _, e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]


def test_output_items_echoed_back_merge_into_the_reply_they_came_from() -> None:
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Look it up."}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_b", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "1"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "2"}]},
    ]
    assert responses_input.chat_messages(items) == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Look it up.",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "1"},
        {"role": "tool", "tool_call_id": "call_b", "content": "2"},
    ]


def test_anthropic_blocks_become_chat_messages() -> None:
    messages: list[Any] = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    assert anthropic_input.chat_messages([{"type": "text", "text": "Be brief."}], messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Look it up.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Rome"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0]"),
        # a tool the client runs that cannot be shown as a function (hosted ones are left out instead)
        ({"input": "Hi", "tools": [{"type": "local_shell"}]}, "tools[0]"),
        ({"input": "Hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "Hi", "max_output_tokens": "ten"}, "max_output_tokens"),
        # the Response echoes metadata, whose values OpenAI's types hold as strings only
        ({"input": "Hi", "metadata": {"": None}}, "metadata."),
        ({"input": "Hi", "metadata": {"k": 1}}, "metadata.k"),
    ],
)
async def test_bad_responses_requests_get_openai_errors(
    http: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    response = await http.post("/sessions/bad/v1/responses", json={"model": MODEL_NAME, **body})
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param
    assert (await http.get("/sessions")).json()["data"] == []


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"max_tokens": 5, "messages": [{"role": "robot", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "sometimes"}},
    ],
)
async def test_bad_messages_requests_get_anthropic_errors(http: httpx.AsyncClient, body: dict[str, Any]) -> None:
    response = await http.post("/sessions/bad/v1/messages", json={"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
    assert (await http.get("/sessions")).json()["data"] == []


async def test_a_response_stored_with_store_false_cannot_be_continued(http: httpx.AsyncClient) -> None:
    first = await http.post(
        "/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 3, "store": False}
    )
    assert first.status_code == 200
    again = await http.post(
        "/v1/responses", json={"model": MODEL_NAME, "input": "More", "previous_response_id": first.json()["id"]}
    )
    assert again.status_code == 404 and again.json()["error"]["code"] == "previous_response_not_found"


async def test_tokens_as_token_ids_on_responses_and_messages(http: httpx.AsyncClient) -> None:
    common = {"model": MODEL_NAME, "return_tokens_as_token_ids": True, "temperature": 0}
    body = {
        **common,
        "input": "Hi",
        "max_output_tokens": 4,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 1,
    }
    reply = (await http.post("/v1/responses", json=body)).json()
    assert [e["token"] for e in reply["output_logprobs"]] == [f"token_id:{t}" for t in reply["token_ids"]]
    assert all(top["token"].startswith("token_id:") for e in reply["output_logprobs"] for top in e["top_logprobs"])
    body = {**common, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True}
    message = (await http.post("/v1/messages", json=body)).json()
    assert [e["token"] for e in message["logprobs"]] == [f"token_id:{t}" for t in message["token_ids"]]


# -- the same checks in every chat-like dialect ----------------------------------------------------
_CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
_RESPONSES = ("/v1/responses", {"input": "Hi", "max_output_tokens": 4})
_MESSAGES = ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
_SAME_CHECKS = [
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs too large", {"logprobs": True, "include": [LOGPROBS_INCLUDE], "top_logprobs": 50}, None),
    ("unknown rewrite policy", {"rewrite_policy": "yolo"}, "rewrite_policy"),
    ("min_p too large", {"min_p": 2}, "min_p"),
    ("top_k not an integer", {"top_k": "x"}, "top_k"),
    ("top_k below -1", {"top_k": -5}, "top_k"),  # vLLM's rule: -1 and 0 are off, below -1 is refused
    ("chat_template_kwargs not an object", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("route", "base"), [_CHAT, _RESPONSES, _MESSAGES], ids=["chat", "responses", "messages"])
@pytest.mark.parametrize(("name", "change", "param"), _SAME_CHECKS, ids=[c[0] for c in _SAME_CHECKS])
async def test_every_chat_like_dialect_checks_the_same_fields(
    http: httpx.AsyncClient, route: str, base: dict[str, Any], name: str, change: dict[str, Any], param: str | None
) -> None:
    """A field one dialect rejects, every dialect rejects, in its own error shape, changing nothing."""
    body = {"model": MODEL_NAME, **base, **change}
    response = await http.post(f"/sessions/checked{route}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if param is not None:
        if route == "/v1/messages":  # Anthropic's shape carries no param: the message names the field
            assert param in error["message"]
        else:
            assert error["param"] == param
    assert (await http.get("/sessions")).json()["data"] == []


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "top_k": -5}, "top_k"),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "top_k": -5}},
            "sampling_params.top_k",
        ),
    ],
    ids=["completions", "generate"],
)
async def test_top_k_below_minus_one_is_refused_by_the_token_dialects_too(
    http: httpx.AsyncClient, route: str, body: dict[str, Any], param: str
) -> None:
    response = await http.post(f"/sessions/checked{route}", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and "-5" in response.json()["error"]["message"]
    assert (await http.get("/sessions")).json()["data"] == []


async def test_top_k_minus_one_is_off_as_in_vllm(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "top_k": -1}
    assert (await http.post("/sessions/off/v1/chat/completions", json=body)).status_code == 200


async def test_messages_take_the_trainer_fields_of_chat(renderer: Renderer) -> None:
    """`min_p`, `top_k`, `seed` and `rewrite_policy` reach the engine from Messages as from chat: the
    engine is asked the same thing on both routes (a recording engine: two sampled runs of one seed
    may differ where a cached prefix changes the rounding)."""
    asked: list[tuple[SamplingParams, int | None]] = []

    class Recording(ScriptedEngine):
        def generate(self, prompt: Any, params: SamplingParams, *, seed: int | None, **options: Any) -> Any:
            asked.append((params, seed))
            return super().generate(prompt, params, seed=seed, **options)

    engine = Recording(renderer.tokenizer.encode("Fine."), renderer.tokenizer.encode("<|im_end|>")[0])
    app = build(engine, renderer).app
    common = {"max_tokens": 6, "temperature": 1.0, "min_p": 0.05, "top_k": 20, "seed": 11, "rewrite_policy": "fork"}
    messages = [{"role": "user", "content": "Hi"}]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        chat = await http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, **common})
        message = await http.post("/v1/messages", json={"model": MODEL_NAME, "messages": messages, **common})
        assert chat.status_code == message.status_code == 200, (chat.text, message.text)
        policies = [s["policy"] for s in (await http.get("/sessions")).json()["data"]]
    (chat_params, chat_seed), (message_params, message_seed) = asked
    assert (chat_params.min_p, chat_params.top_k, chat_params.temperature) == (0.05, 20, 1.0)
    assert message_params == chat_params and message_seed == chat_seed is not None
    assert policies == ["fork", "fork"]


# -- nothing that can fail runs after the turn is recorded -----------------------------------------
async def test_the_previous_response_is_looked_up_once_before_the_turn(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored response that goes (evicted by other traffic) while a turn that continues it runs
    must not turn that recorded turn into an error: its conversation is read once, before the turn."""
    first = await http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 3})
    first_id = first.json()["id"]
    real = responses_history.ResponseHistory.recall
    looked_up: list[str] = []

    def recall_once(self: responses_history.ResponseHistory, response_id: str) -> Any:
        looked_up.append(response_id)
        found = real(self, response_id)
        self._entries.pop(response_id)  # gone for any later look-up, as an eviction would do
        return found

    monkeypatch.setattr(responses_history.ResponseHistory, "recall", recall_once)
    for stream in (False, True):
        body = {"model": MODEL_NAME, "input": "More", "max_output_tokens": 3, "previous_response_id": first_id}
        response = await http.post("/v1/responses", json={**body, "stream": stream})
        assert response.status_code == 200, response.text
        assert "event: error" not in response.text
        first_id = response.json()["id"] if not stream else _events(response.text)[-1][1]["response"]["id"]
    assert len(looked_up) == 2  # once per request
    session = first.json()["session_id"]
    (branch,) = (await http.get(f"/sessions/{session}/export")).json()["branches"]
    assert len(branch["turn_ids"]) == 3  # one branch, extended twice


@pytest.mark.parametrize("route", ["responses", "messages"])
@pytest.mark.parametrize("stream", [False, True])
async def test_no_sdk_validation_runs_on_a_recorded_turn(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, route: str, stream: bool
) -> None:
    """The SDK-type checks of response bodies are the tests' (tests/support/sdk_shapes.py): on the
    serving path the turn is already recorded, and a failure there would answer 500 for it. Every
    SDK module is made unimportable while the turn is served, so a lazy import of one fails it."""
    if route == "responses":
        body: dict[str, Any] = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 3}
    else:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    with monkeypatch.context() as blocked:
        for name in list(sys.modules):
            if name.split(".")[0] in ("anthropic", "openai"):
                blocked.setitem(sys.modules, name, None)  # type: ignore[arg-type]
        response = await http.post(f"/v1/{route}", json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    assert "event: error" not in response.text
    with pytest.raises(pydantic.ValidationError):  # the tests' own checks do use the SDK's types
        (check_response if route == "responses" else check_message)({})


def test_the_gateway_never_imports_the_sdks_nor_aiohttp() -> None:
    """`tokentape serve` on the embedded engine, started and answering, has loaded neither SDK (their
    type unions alone take about a second to import and build) nor aiohttp with the remote engines'
    modules (about 0.3 s): each start paid for them."""
    code = """
import sys, uvicorn
from starlette.testclient import TestClient
from typer.testing import CliRunner

def run(app, **_):
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200

uvicorn.run = run
from tokentape.cli import app
result = CliRunner().invoke(app, ["serve", "--store", ":memory:", "--log-level", "warning"])
assert result.exit_code == 0, result.output
print(sorted({m.split(".")[0] for m in sys.modules} & {"aiohttp", "anthropic", "openai"}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


async def test_whole_bodies_are_the_sdks_types(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4, "include": [LOGPROBS_INCLUDE]}
    check_response((await http.post("/v1/responses", json=body)).json())
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True}
    check_message((await http.post("/v1/messages", json=body)).json())

"""End to end: a real `tokentape serve` process on the embedded model, driven by the real openai SDK.

The claim under test: what every call returned (prompt_token_ids, token_ids, logprobs) is exactly
what the session export holds, turn after turn, including streamed and truncated turns and n=2.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.browser import chromium
from tests.support.scenarios import five_turn_scenario
from tokentape.client import InProcessGateway
from tokentape.launcher import RunningServer, running_server
from tokentape.served import ServeSpec

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(["--context-length", "2048"]) as running:
        yield running


@pytest.fixture(scope="module")
def model(server: RunningServer) -> str:
    name: str = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    return name


def _client(server: RunningServer, session: str | None = None, **kwargs: Any) -> openai.AsyncOpenAI:
    base = server.session_url(session) if session else f"{server.base_url}/v1"
    return openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, **kwargs)


def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {})[name]


def _tokenize(server: RunningServer, **body: Any) -> list[int]:
    tokens: list[int] = httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"]
    return tokens


async def test_five_turns_are_exported_exactly_as_they_were_served(server: RunningServer, model: str) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        await five_turn_scenario(_client(server, "five-turns"), model, http, "five-turns")


async def test_n_two_makes_two_branches(server: RunningServer, model: str) -> None:
    client = _client(server, "two-choices")
    messages: list[Any] = [{"role": "user", "content": "Name an animal."}]
    reply = await client.chat.completions.create(
        model=model, messages=messages, n=2, max_tokens=24, temperature=1.0, seed=3
    )
    assert [c.index for c in reply.choices] == [0, 1]
    prompt = _extra(reply, "prompt_token_ids")
    first, second = (_extra(c, "token_ids") for c in reply.choices)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "Why that one?"},
    ]
    follow = await client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert _extra(follow, "prompt_token_ids")[: len(prompt) + len(first)] == prompt + first

    export = httpx.get(f"{server.base_url}/sessions/two-choices/export").json()
    assert len(export["branches"]) == 2
    by_length = sorted(export["branches"], key=lambda b: len(b["tokens"]))
    assert by_length[0]["tokens"] == prompt + second
    assert by_length[1]["tokens"][: len(prompt) + len(first)] == prompt + first
    assert by_length[1]["tokens"][-len(_extra(follow.choices[0], "token_ids")) :] == _extra(
        follow.choices[0], "token_ids"
    )


@pytest.mark.parametrize("way", ["base_url", "header", "body"])
async def test_each_way_of_naming_a_session_records_into_it(server: RunningServer, model: str, way: str) -> None:
    session = f"named-by-{way}"
    if way == "base_url":
        client, extra = _client(server, session), {}
    elif way == "header":
        client, extra = _client(server, default_headers={"X-Session-ID": session}), {}
    else:
        client, extra = _client(server), {"extra_body": {"session_id": session}}
    messages: list[Any] = [{"role": "user", "content": "Hello"}]
    for _ in range(2):
        reply = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, **extra
        )
        assert _extra(reply, "session_id") == session
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "And then?"},
        ]
    summary = httpx.get(f"{server.base_url}/sessions/{session}").json()
    assert (summary["turns"], summary["branches"], summary["rewrites"]) == (2, 1, 0)


async def test_calls_without_a_session_each_get_their_own(server: RunningServer, model: str) -> None:
    client = _client(server)
    ids = set()
    for _ in range(2):
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        ids.add(_extra(reply, "session_id"))
    assert len(ids) == 2
    for session in ids:
        assert httpx.get(f"{server.base_url}/sessions/{session}").json()["turns"] == 1


async def test_completions_take_text_or_token_prompts_and_extend_sessions(server: RunningServer, model: str) -> None:
    client = _client(server, "raw")
    prompt = _tokenize(server, prompt="The capital of France is")
    first = await client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    assert _extra(first, "prompt_token_ids") == prompt
    ids = _extra(first.choices[0], "token_ids")
    assert first.choices[0].logprobs is not None and len(first.choices[0].logprobs.token_logprobs or []) == len(ids)
    by_text = await client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert _extra(by_text.choices[0], "token_ids") == ids
    follow = await client.completions.create(
        model=model, prompt=prompt + ids + _tokenize(server, prompt=" Yes."), max_tokens=3, temperature=0
    )
    assert follow.choices[0].finish_reason in ("stop", "length")
    export = httpx.get(f"{server.base_url}/sessions/raw/export").json()
    longest = max(export["branches"], key=lambda b: len(b["tokens"]))
    assert longest["tokens"][: len(prompt) + len(ids)] == prompt + ids
    assert len(longest["action_ranges"]) == 2


async def test_models_health_tokenize_and_session_routes(server: RunningServer, model: str) -> None:
    base = server.base_url
    models = httpx.get(f"{base}/sessions/x/v1/models").json()
    assert models["data"][0]["id"] == model and models["data"][0]["max_model_len"] == 2048
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    text_tokens = _tokenize(server, prompt="hello world")
    detok = httpx.post(f"{base}/detokenize", json={"tokens": text_tokens}).json()
    assert detok["prompt"] == "hello world"
    # its own sessions: the other tests of this module may run before or after it
    for session in ("listed-a", "listed-b"):
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert httpx.post(f"{base}/sessions/{session}/v1/chat/completions", json=body, timeout=60).status_code == 200
    listed = {s["session_id"] for s in httpx.get(f"{base}/sessions").json()["data"]}
    assert {"listed-a", "listed-b"} <= listed
    assert httpx.delete(f"{base}/sessions/listed-b").json()["deleted"] is True
    assert httpx.get(f"{base}/sessions/listed-b").status_code == 404
    assert httpx.get(f"{base}/sessions/listed-a").status_code == 200


def test_the_plain_sdk_example_records_its_episode(server: RunningServer) -> None:
    script = Path(__file__).resolve().parents[2] / "examples" / "openai_sdk_agent.py"
    done = subprocess.run(
        [sys.executable, str(script), "--base", server.base_url, "--episode", "example-run"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "training data:" in done.stdout
    summary = httpx.get(f"{server.base_url}/sessions/example-run").json()
    assert (summary["turns"], summary["branches"], summary["rewrites"]) == (2, 1, 0)


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    """A response without what differs by design between two servers (ids, times, session names) and
    without what the engine sampled: two engines with different cache histories batch and round
    differently (docs: the embedded engine), so the sampled tokens are compared by shape only."""
    body = {k: v for k, v in body.items() if k not in ("id", "created", "session_id")}
    if "usage" in body:
        body["usage"] = {"prompt_tokens": body["usage"]["prompt_tokens"]}
    body["choices"] = [_shape(choice) for choice in body.get("choices", [])]
    return body


def _shape(value: Any) -> Any:
    """The keys and value types of a sampled choice, not its values."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


async def test_the_in_process_client_answers_exactly_like_the_server(server: RunningServer, model: str) -> None:
    local = InProcessGateway(ServeSpec(context_length=2048))
    try:
        await five_turn_scenario(local.client("five-local"), local.model, local.http, "five-local")
        requests: list[dict[str, Any]] = [
            {
                "model": model,
                "messages": [{"role": "user", "content": "Name a colour."}],
                "max_tokens": 12,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            },
            {"model": model, "messages": [], "max_tokens": 3},
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            {"model": model, "messages": [{"role": "user", "content": "x"}], "temperature": 9},
        ]
        async with httpx.AsyncClient(base_url=server.base_url) as remote:
            for body in requests:
                there = await remote.post("/sessions/cmp/v1/chat/completions", json=body)
                here = await local.http.post("/sessions/cmp/v1/chat/completions", json=body)
                assert here.status_code == there.status_code
                assert _comparable(here.json()) == _comparable(there.json())
            raw = {"model": model, "prompt": "1, 2, 3,", "max_tokens": 5, "temperature": 0, "logprobs": 1}
            there = await remote.post("/v1/completions", json=raw)
            here = await local.http.post("/v1/completions", json=raw)
            assert _comparable(here.json()) == _comparable(there.json())
    finally:
        await local.aclose()


async def test_verifiers_reads_token_data_from_responses(model: str) -> None:
    """The access pattern of verifiers' parse_response_tokens (chat: top-level prompt_token_ids,
    choices[0].token_ids, choices[0].logprobs.content[j].logprob; completions: the same on the choice,
    with logprobs.token_logprobs), applied to what the in-process client returns."""
    local = InProcessGateway(ServeSpec(context_length=2048))
    try:
        client = local.client("vf")
        chat = await client.chat.completions.create(
            model=local.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, logprobs=True
        )
        choice = chat.choices[0]
        assert hasattr(chat, "prompt_token_ids") and hasattr(choice, "token_ids")
        assert choice.logprobs is not None and choice.logprobs.content is not None
        prompt_ids = chat.prompt_token_ids  # type: ignore[attr-defined]
        completion_ids = choice.token_ids  # type: ignore[attr-defined]
        completion_logprobs = [token.logprob for token in choice.logprobs.content]
        (branch,) = (await local.export("vf"))["branches"]
        assert branch["tokens"] == prompt_ids + completion_ids
        assert branch["logprobs"][len(prompt_ids) :] == completion_logprobs
        text = await client.completions.create(model=local.model, prompt="Once upon", max_tokens=4, logprobs=0)
        first = text.choices[0]
        assert first.prompt_token_ids and first.token_ids  # type: ignore[attr-defined]
        assert first.logprobs is not None and len(first.logprobs.token_logprobs or []) == len(first.token_ids)  # type: ignore[attr-defined]
    finally:
        await local.aclose()


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=8000",
    "--window-size=1400,900",
]


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    binary = chromium()
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    return subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


async def test_the_viewer_shows_a_recorded_session_in_a_browser(
    server: RunningServer, model: str, tmp_path: Path
) -> None:
    chromium()  # skips first where there is none
    session = "viewed"
    client = _client(server, session)
    messages: list[Any] = [{"role": "user", "content": "Name three fruits."}]
    reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=16, n=2, seed=1)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "And vegetables?"},
    ]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=12, seed=2)
    export = httpx.get(f"{server.base_url}/sessions/{session}/export", params={"texts": "true"}).json()
    shown = max(export["branches"], key=lambda b: b["branch_id"])  # the page opens the newest branch

    dom = _chromium(tmp_path, "--dump-dom", f"{server.base_url}/view#session={session}").stdout
    assert 'data-ready="true"' in dom
    assert dom.count('data-origin="sampled"') == sum(shown["loss_mask"])
    assert dom.count('data-origin="bridge"') == shown["origins"].count("bridge")
    assert dom.count('class="node') == len({t for b in export["branches"] for t in b["turn_ids"]})
    # one naming: the text's turn badges and the tree's nodes both name a turn by its id
    badges = [int(t) for t in re.findall(r'<span class="turn[^"]*">turn (\d+)', dom)]
    assert badges == shown["turn_ids"] and badges != list(range(len(badges)))  # ids, not positions
    assert set(badges) <= {int(t) for t in re.findall(r'class="node[^"]*"[^>]*>turn (\d+)', dom)}
    assert "fruits" in dom and "vegetables" in dom

    output = Path(__file__).resolve().parents[2] / "test-output"
    output.mkdir(exist_ok=True)
    screenshot = output / "viewer.png"
    _chromium(tmp_path, f"--screenshot={screenshot}", f"{server.base_url}/view#session={session}")
    assert screenshot.stat().st_size > 10_000

    snapshot = output / "viewer.html"
    done = subprocess.run(
        [sys.executable, "-m", "tokentape", "view", "--url", server.base_url, "--out", str(snapshot)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "static snapshot" in done.stdout
    static_dom = _chromium(tmp_path, "--dump-dom", f"{snapshot.as_uri()}#session={session}").stdout
    assert static_dom.count('data-origin="sampled"') == sum(shown["loss_mask"])

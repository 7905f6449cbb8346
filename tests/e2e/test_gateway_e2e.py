"""End to end: a real `tokentape serve` process on the embedded model, driven by the real openai SDK.

The claim under test: what every call returned (prompt_token_ids, token_ids, logprobs) is exactly
what the session export holds, turn after turn, including streamed and truncated turns and n=2.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tokentape.launcher import RunningServer, running_server

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


async def _streamed_turn(client: openai.AsyncOpenAI, **kwargs: Any) -> dict[str, Any]:
    stream = await client.chat.completions.create(stream=True, **kwargs)
    prompt: list[int] = []
    text, ids, logprobs, finish = "", [], [], None
    async for chunk in stream:
        extra = chunk.model_extra or {}
        prompt = extra.get("prompt_token_ids", prompt)
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += (choice.model_extra or {}).get("token_ids", [])
            if choice.logprobs and choice.logprobs.content:
                logprobs += [entry.logprob for entry in choice.logprobs.content]
            finish = choice.finish_reason or finish
    return {"prompt": prompt, "ids": ids, "text": text, "logprobs": logprobs, "finish": finish}


async def _plain_turn(client: openai.AsyncOpenAI, **kwargs: Any) -> dict[str, Any]:
    reply = await client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    return {
        "prompt": _extra(reply, "prompt_token_ids"),
        "ids": _extra(choice, "token_ids"),
        "text": choice.message.content,
        "logprobs": [entry.logprob for entry in choice.logprobs.content],
        "finish": choice.finish_reason,
    }


def _tokenize(server: RunningServer, **body: Any) -> list[int]:
    tokens: list[int] = httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"]
    return tokens


async def test_five_turns_are_exported_exactly_as_they_were_served(server: RunningServer, model: str) -> None:
    client = _client(server, "five-turns")
    questions = ["What is a cat?", "Tell me more.", "Why?", "Give an example.", "Thanks, summarise."]
    messages: list[Any] = []
    calls = []
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "temperature": 0.8,
            "seed": turn,
            "max_tokens": 3 if turn == 2 else 40,
        }
        call = await (_streamed_turn(client, **kwargs) if turn == 1 else _plain_turn(client, **kwargs))
        calls.append(call)
        messages.append({"role": "assistant", "content": call["text"]})
    assert calls[2]["finish"] == "length"
    assert calls[1]["ids"] and calls[1]["prompt"]

    export = httpx.get(f"{server.base_url}/sessions/five-turns/export").json()
    (branch,) = export["branches"]
    tokens, mask, logprobs = branch["tokens"], branch["loss_mask"], branch["logprobs"]
    assert len(tokens) == len(mask) == len(logprobs) == len(branch["origins"]) == len(branch["turns"])
    for call, (start, end) in zip(calls, branch["action_ranges"], strict=True):
        assert tokens[: len(call["prompt"])] == call["prompt"]
        assert (start, end) == (len(call["prompt"]), len(call["prompt"]) + len(call["ids"]))
        assert tokens[start:end] == call["ids"]
        assert mask[start:end] == [1] * len(call["ids"])
        assert logprobs[start:end] == pytest.approx(call["logprobs"], abs=1e-12)
    assert sum(mask) == sum(len(c["ids"]) for c in calls)
    assert all((lp is None) == (m == 0) for lp, m in zip(logprobs, mask, strict=True))
    assert branch["finish_reasons"][2] == "length"
    assert branch["truncated"] is False and branch["finish_reasons"][-1] in ("stop", "length")

    # no turn close doubled or dropped: as many as the template's own rendering of the whole episode
    (im_end,) = _tokenize(server, prompt="<|im_end|>")
    rendered = _tokenize(server, messages=messages, add_generation_prompt=False)
    closed_last = calls[-1]["finish"] == "stop"
    assert tokens.count(im_end) == rendered.count(im_end) - (0 if closed_last else 1)
    assert all(not (a == b == im_end) for a, b in itertools.pairwise(tokens))


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
    listed = {s["session_id"] for s in httpx.get(f"{base}/sessions").json()["data"]}
    assert {"five-turns", "two-choices"} <= listed
    assert httpx.delete(f"{base}/sessions/two-choices").json()["deleted"] is True
    assert httpx.get(f"{base}/sessions/two-choices").status_code == 404


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

"""Scenarios shared by the HTTP end-to-end tests and the in-process client tests."""

from __future__ import annotations

import itertools
from typing import Any

import openai
import pytest


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


async def five_turn_scenario(client: openai.AsyncOpenAI, model: str, http: Any, session: str) -> None:
    """Five turns (one streamed, one cut by max_tokens); every call must equal the export."""
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
            "logprobs": True,
            "max_tokens": 3 if turn == 2 else 40,
        }
        call = await (_streamed_turn(client, **kwargs) if turn == 1 else _plain_turn(client, **kwargs))
        calls.append(call)
        messages.append({"role": "assistant", "content": call["text"]})
    assert calls[2]["finish"] == "length", calls[2]
    assert calls[1]["ids"] and calls[1]["prompt"]

    export = (await http.get(f"/sessions/{session}/export")).json()
    (branch,) = export["branches"]
    tokens, mask, logprobs = branch["tokens"], branch["loss_mask"], branch["logprobs"]
    assert len(tokens) == len(mask) == len(logprobs) == len(branch["origins"]) == len(branch["turn_index"])
    for call, (start, end) in zip(calls, branch["action_ranges"], strict=True):
        assert tokens[: len(call["prompt"])] == call["prompt"]
        assert (start, end) == (len(call["prompt"]), len(call["prompt"]) + len(call["ids"]))
        assert tokens[start:end] == call["ids"]
        assert mask[start:end] == [1] * len(call["ids"])
        assert logprobs[start:end] == pytest.approx(call["logprobs"], abs=1e-12)
    assert sum(mask) == sum(len(c["ids"]) for c in calls)
    assert all((lp is None) == (m == 0) for lp, m in zip(logprobs, mask, strict=True))
    assert branch["finish_reasons"][2] == "length"
    # whether the episode ends on a stop depends on the model's weights; the flag must agree with it
    assert branch["finish_reasons"][-1] in ("stop", "length")
    assert branch["truncated"] is (branch["finish_reasons"][-1] == "length")

    # no turn close doubled or dropped: as many as the template's own rendering of the whole episode
    (im_end,) = (await http.post("/tokenize", json={"prompt": "<|im_end|>"})).json()["tokens"]
    rendered = (await http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()[
        "tokens"
    ]
    closed_last = calls[-1]["finish"] == "stop"
    assert tokens.count(im_end) == rendered.count(im_end) - (0 if closed_last else 1)
    assert all(not (a == b == im_end) for a, b in itertools.pairwise(tokens))

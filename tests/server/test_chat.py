"""Chat and completion behaviour through the real app and model: stop strings, logprobs, streaming
with n>1, usage, and what each lands as on the tape."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from tests.conftest import MODEL_NAME

HI = [{"role": "user", "content": "Count from one to twenty, separated by commas."}]


async def _export(http: httpx.AsyncClient, session: str) -> dict[str, Any]:
    export: dict[str, Any] = (await http.get(f"/sessions/{session}/export")).json()
    return export


async def test_a_stop_string_ends_the_text_but_its_tokens_stay_on_the_tape(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL_NAME, "messages": HI, "max_tokens": 60, "temperature": 0, "stop": [" "]}
    data = (await http.post("/sessions/st/v1/chat/completions", json=body)).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] and " " not in choice["message"]["content"]
    pieces = (await http.post("/detokenize", json={"tokens": choice["token_ids"]})).json()["prompt"]
    assert pieces.startswith(choice["message"]["content"]) and " " in pieces[len(choice["message"]["content"]) :]
    # the next turn bridges the whole turn close: the engine never sampled one
    (im_end,) = (await http.post("/tokenize", json={"prompt": "<|im_end|>"})).json()["tokens"]
    history = [*HI, {"role": "assistant", "content": choice["message"]["content"]}, {"role": "user", "content": "Go"}]
    follow = (await http.post("/sessions/st/v1/chat/completions", json={**body, "messages": history})).json()
    start = len(data["prompt_token_ids"]) + len(choice["token_ids"])
    assert follow["prompt_token_ids"][start] == im_end
    (branch,) = (await _export(http, "st"))["branches"]
    assert branch["origins"][start] == "bridge"


async def test_logprobs_come_with_token_ids_and_ranked_alternatives(sdk: openai.AsyncOpenAI) -> None:
    reply = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=HI, max_tokens=8, temperature=0.5, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    ids = (reply.choices[0].model_extra or {})["token_ids"]
    assert [(e.model_extra or {})["token_id"] for e in content] == ids
    for entry in content:
        assert len(entry.top_logprobs) == 3
        ranked = [alt.logprob for alt in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert entry.logprob <= 0.0


async def test_logprobs_only_when_asked_and_the_tape_keeps_them_either_way(
    sdk: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    """As OpenAI answers: no `logprobs: true`, no logprobs in the response (streamed or not); token
    IDs always; the tape records the sampled logprobs whether the client asked or not."""
    plain = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=HI, max_tokens=6, temperature=0.7, extra_body={"session_id": "lp-off"}
    )
    assert plain.choices[0].logprobs is None
    ids = (plain.choices[0].model_extra or {})["token_ids"]
    assert len(ids) == plain.usage.completion_tokens  # type: ignore[union-attr]
    chunks = await sdk.chat.completions.create(
        model=MODEL_NAME, messages=HI, max_tokens=6, temperature=0.7, stream=True, extra_body={"session_id": "lp-s"}
    )
    streamed_ids: list[int] = []
    async for chunk in chunks:
        for choice in chunk.choices:
            assert choice.logprobs is None
            streamed_ids += (choice.model_extra or {})["token_ids"]
    assert streamed_ids
    (branch,) = (await _export(http, "lp-off"))["branches"]
    sampled = [lp for lp, mask in zip(branch["logprobs"], branch["loss_mask"], strict=True) if mask]
    assert len(sampled) == len(ids) and all(lp <= 0.0 for lp in sampled) and any(lp < 0.0 for lp in sampled)


async def test_streaming_n_two_gives_each_choice_its_own_tokens(
    sdk: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    stream = await sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=HI,
        max_tokens=10,
        n=2,
        temperature=1.0,
        seed=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"session_id": "sn"},
    )
    ids: dict[int, list[int]] = {0: [], 1: []}
    finishes: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            ids[choice.index] += (choice.model_extra or {})["token_ids"]
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1}
    assert usage is not None and usage.completion_tokens == len(ids[0]) + len(ids[1])
    export = await _export(http, "sn")
    sampled = sorted(
        [t for t, o in zip(b["tokens"], b["origins"], strict=True) if o == "sampled"] for b in export["branches"]
    )
    assert sampled == sorted([ids[0], ids[1]])


async def test_completion_streams_carry_token_ids(http: httpx.AsyncClient) -> None:
    """The chunks' token IDs are the tokens the turn sampled, as its tape records them, and they spell
    the streamed text (compared with the same turn's record, not with a second generation: on the
    shipped 4-bit weights a rerun beside other cached KV may round to another greedy token)."""
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "stream": True}
    streamed: list[int] = []
    text = ""
    async with http.stream("POST", "/sessions/cs/v1/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
        streamed += choice["token_ids"]
        text += choice["text"]
    assert streamed
    (branch,) = (await _export(http, "cs"))["branches"]
    assert streamed == [t for t, o in zip(branch["tokens"], branch["origins"], strict=True) if o == "sampled"]
    assert (await http.post("/detokenize", json={"tokens": streamed})).json()["prompt"] == text


async def test_max_completion_tokens_caps_the_reply(sdk: openai.AsyncOpenAI) -> None:
    reply = await sdk.chat.completions.create(model=MODEL_NAME, messages=HI, max_completion_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 3

"""vLLM's token route, `/inference/v1/generate`, at the root and under a session: vLLM's request and
response shapes, a token prompt that extends the session branch it starts with, and the reading
rules of the renderers package's client (what verifiers' training client uses)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx

from tokentape.render.tokenizer import GGUFTokenizer

CHAT = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"


def _check_as_renderers_does(body: dict[str, Any]) -> list[float]:
    """The renderers client's rules for this route: one logprob entry per token, each spelt
    'token_id:N' for the token at its position, a finite number that is not vLLM's -9999 floor."""
    choice = body["choices"][0]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert len(content) == len(ids)
    values = []
    for token, entry in zip(ids, content, strict=True):
        assert entry["token"] == f"token_id:{token}"
        assert isinstance(entry["logprob"], float) and math.isfinite(entry["logprob"]) and entry["logprob"] != -9999.0
        values.append(entry["logprob"])
    return values


async def test_generate_answers_in_vllms_shape(http: httpx.AsyncClient, tokenizer: GGUFTokenizer) -> None:
    prompt = tokenizer.encode(CHAT)
    body = {
        "model": "smollm2-135m-instruct",
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 12, "temperature": 0, "logprobs": 2},
    }
    response = await http.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert set(data) >= {"request_id", "choices", "prompt_logprobs", "kv_transfer_params"}
    assert data["prompt_token_ids"] == prompt
    logprobs = _check_as_renderers_does(data)
    choice = data["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert all(
        len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"].startswith("token_id:")
        for e in choice["logprobs"]["content"]
    )
    (branch,) = (await http.get(f"/sessions/{data['session_id']}/export")).json()["branches"]
    assert branch["tokens"] == prompt + choice["token_ids"]
    assert [lp for lp in branch["logprobs"] if lp is not None] == logprobs


async def test_a_token_prompt_extends_the_session_branch(http: httpx.AsyncClient, tokenizer: GGUFTokenizer) -> None:
    first_prompt = tokenizer.encode(CHAT)
    params = {"max_tokens": 8, "temperature": 0, "logprobs": 1}
    url = "/sessions/gen/inference/v1/generate"
    first = (await http.post(url, json={"token_ids": first_prompt, "sampling_params": params})).json()
    sampled = first["choices"][0]["token_ids"]
    follow = (
        first_prompt + sampled + tokenizer.encode("\n<|im_start|>user\nAnother.<|im_end|>\n<|im_start|>assistant\n")
    )
    # verifiers' eval client names its trace in X-Session-ID; the base URL still names the session
    second = await http.post(
        url, json={"token_ids": follow, "sampling_params": params}, headers={"X-Session-ID": "trace-1"}
    )
    assert second.status_code == 200, second.text
    tape = (await http.get("/sessions/gen/export")).json()
    (branch,) = tape["branches"]
    assert branch["tokens"] == follow + second.json()["choices"][0]["token_ids"]
    assert branch["origins"][len(first_prompt) : len(first_prompt) + len(sampled)] == ["sampled"] * len(sampled)
    assert branch["trace_ids"] == [None, "trace-1"]


async def test_streamed_generate(http: httpx.AsyncClient, tokenizer: GGUFTokenizer) -> None:
    prompt = tokenizer.encode(CHAT)
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 6, "temperature": 0, "logprobs": 0}, "stream": True}
    async with http.stream("POST", "/sessions/gen-stream/inference/v1/generate", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    (branch,) = (await http.get("/sessions/gen-stream/export")).json()["branches"]
    assert branch["tokens"] == prompt + tokens


async def test_bad_generate_requests(http: httpx.AsyncClient) -> None:
    for body, param in (
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1, 2], "sampling_params": {"logprobs": 99}}, "sampling_params.logprobs"),
        ({"token_ids": [10**9], "sampling_params": {}}, "prompt"),
        ({"token_ids": "hello", "sampling_params": {}}, "token_ids"),
    ):
        response = await http.post("/inference/v1/generate", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert (await http.get("/sessions")).json()["data"] == []

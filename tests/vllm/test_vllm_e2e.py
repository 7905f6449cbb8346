"""A real `tokentape serve --engine vllm=URL --tokenizer DIR` (and `vllm-generate=URL`) in front of a
real vLLM on the CPU, driven by the real openai SDK and plain HTTP.

What every call returned and what the session exports must equal what vLLM sent (read from a
recording proxy between the two): the prompt tokens vLLM reports, the token IDs it sampled and their
logprobs. Also: n=2, stop strings, a client that leaves (vLLM must stop generating), top_logprobs,
and tokens/s through the gateway against calling vLLM directly with the same tokens.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.support.recording_proxy import Exchange, RecordingProxy
from tests.support.scenarios import five_turn_scenario
from tests.vllm.conftest import FIGURES, KINDS, MODEL, VLLM_PYTHON, VLLMServer
from tokentape.launcher import RunningServer

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="a real vLLM runs under `make e2e-vllm` only (minutes of CPU; not part of make test)"
    ),
    pytest.mark.timeout(900),  # the first test also converts the model and starts vLLM
]

Proxy = tuple[str, RecordingProxy]
# A raw prompt the model continues greedily for as long as it is allowed to.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


# -- what vLLM sent, read from its own answers ---------------------------------------------------------
def _choices(exchange: Exchange) -> list[dict[str, Any]]:
    if exchange.streamed:
        return [c for event in exchange.events() for c in event.get("choices", [])]
    choices: list[dict[str, Any]] = exchange.json()["choices"]
    return choices


def sampled_by_vllm(exchange: Exchange) -> tuple[list[int], list[float]]:
    """The token IDs vLLM sent and their logprobs, from `/v1/completions` (`token_logprobs`) or
    `/inference/v1/generate` (`logprobs.content[j].logprob`), streamed or not."""
    ids: list[int] = []
    logprobs: list[float] = []
    for choice in _choices(exchange):
        entries = choice.get("logprobs") or {}
        if "token_logprobs" in entries:  # completions: the IDs spelled `token_id:N` (return_tokens_as_token_ids)
            spelled = [int(token.removeprefix("token_id:")) for token in entries.get("tokens") or []]
            ids += choice.get("token_ids") or spelled
            if choice.get("token_ids") is not None:
                assert choice["token_ids"] == spelled
            logprobs += entries["token_logprobs"]
        else:
            ids += choice.get("token_ids") or []
            logprobs += [entry["logprob"] for entry in entries.get("content") or []]
    return ids, logprobs


def prompt_sent(exchange: Exchange) -> list[int]:
    assert exchange.body is not None
    prompt: list[int] = exchange.body.get("prompt") or exchange.body["token_ids"]
    return prompt


def prompt_reported(exchange: Exchange) -> tuple[list[int] | None, int | None]:
    """The prompt vLLM says it ran: the token IDs where it echoes them, and its count in `usage`."""
    ids = next((c["prompt_token_ids"] for c in _choices(exchange) if c.get("prompt_token_ids")), None)
    body = exchange.events()[-1] if exchange.streamed else exchange.json()
    ids = ids or body.get("prompt_token_ids")
    count = (body.get("usage") or {}).get("prompt_tokens")
    return ids, count


def _seed(exchange: Exchange) -> int | None:
    body = exchange.body or {}
    seed: int | None = body.get("seed", (body.get("sampling_params") or {}).get("seed"))
    return seed


def _client(server: RunningServer, session: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.session_url(session), api_key="unused", max_retries=0, timeout=300)


def _tokenizer(vllm_server: VLLMServer) -> Tokenizer:
    return Tokenizer.from_file(str(Path(vllm_server.model_dir) / "tokenizer.json"))


async def _chat(server: RunningServer, session: str, **body: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
        response = await http.post(f"/sessions/{session}/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def _export(server: RunningServer, session: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{server.base_url}/sessions/{session}/export", timeout=30).json()
    return data


# -- exactness ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
async def test_five_turns_are_exactly_what_vllm_sampled(
    gateways: dict[str, RunningServer], proxy: Proxy, vllm_server: VLLMServer, kind: str
) -> None:
    server, (_, recorder) = gateways[kind], proxy
    session = f"five-{kind}"
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http, _client(server, session) as client:
        await five_turn_scenario(client, MODEL, http, session)
    (branch,) = _export(server, session)["branches"]
    exchanges = recorder.generations(session)
    assert len(exchanges) == len(branch["action_ranges"]) == 5
    tokens, logprobs = branch["tokens"], branch["logprobs"]
    for exchange, (start, end) in zip(exchanges, branch["action_ranges"], strict=True):
        assert exchange.status == 200
        # the prompt the gateway sent is the tape so far, and it is the prompt vLLM ran
        assert prompt_sent(exchange) == tokens[:start]
        reported_ids, reported_count = prompt_reported(exchange)
        # vLLM 0.32's streamed token route reports neither the prompt nor usage; every other answer does
        if not (kind == "vllm-generate" and exchange.streamed):
            assert reported_ids is not None or reported_count is not None
        if reported_ids is not None:
            assert reported_ids == tokens[:start]
        if reported_count is not None:
            assert reported_count == start
        # every token vLLM sampled is on the tape with the logprob vLLM gave, bit for bit
        ids, values = sampled_by_vllm(exchange)
        assert tokens[start:end] == ids
        assert logprobs[start:end] == values

    # the first prompt is the one vLLM's own chat template renders for the same message
    first = {"model": MODEL, "messages": [{"role": "user", "content": "What is a cat?"}], "add_generation_prompt": True}
    rendered = httpx.post(f"{vllm_server.url}/tokenize", json=first, timeout=30).json()["tokens"]
    assert tokens[: branch["action_ranges"][0][0]] == rendered


@pytest.mark.parametrize("kind", KINDS)
async def test_n_two_records_what_vllm_sampled_for_each_choice(
    gateways: dict[str, RunningServer], proxy: Proxy, vllm_server: VLLMServer, kind: str
) -> None:
    server, (_, recorder) = gateways[kind], proxy
    session = f"n2-{kind}"
    messages = [{"role": "user", "content": "Name an animal and say why you like it."}]
    reply = await _chat(server, session, messages=messages, n=2, max_tokens=24, temperature=1.0, seed=11)
    prompt = reply["prompt_token_ids"]
    exchanges = recorder.generations(session)
    assert len(exchanges) == 2  # one engine request per choice
    seeds = [_seed(e) for e in exchanges]
    assert None not in seeds and seeds[0] != seeds[1]

    sampled = [sampled_by_vllm(e) for e in exchanges]
    assert [c["token_ids"] for c in reply["choices"]] == [ids for ids, _ in sampled]
    assert sampled[0][0] != sampled[1][0]
    branches = _export(server, session)["branches"]
    assert sorted(b["tokens"] for b in branches) == sorted(prompt + ids for ids, _ in sampled)
    for branch in branches:
        ids, values = next(s for s in sampled if prompt + s[0] == branch["tokens"])
        assert branch["logprobs"][len(prompt) :] == values

    # the same requests straight to vLLM, unstreamed: the same tokens (seeded sampling is reproducible)
    for exchange, (ids, _) in zip(exchanges, sampled, strict=True):
        assert exchange.body is not None
        body = {k: v for k, v in exchange.body.items() if k != "stream_options"}
        body.update(stream=False, return_token_ids=True)  # vLLM's own field, asked here only
        again = httpx.post(f"{vllm_server.url}{exchange.path}", json=body, timeout=300)
        assert again.json()["choices"][0]["token_ids"] == ids


# -- stop strings ---------------------------------------------------------------------------------------
def _stop_case(full_text: str) -> str:
    """A stop string from the middle of a reply: the first word past its first third (not near its end,
    where the engine may finish before the gateway closes the stream)."""
    words = [w.strip(".,!?;:") for w in full_text.split()]
    for word in words[len(words) // 3 :]:
        if len(word) >= 4 and full_text.index(word) > len(full_text) // 3:
            return word
    raise AssertionError(f"no usable stop word in {full_text!r}")


@pytest.mark.parametrize("kind", KINDS)
async def test_stop_strings_cut_the_reply_and_the_tape_alike(
    gateways: dict[str, RunningServer], proxy: Proxy, vllm_server: VLLMServer, kind: str
) -> None:
    server, (_, recorder) = gateways[kind], proxy
    messages = [{"role": "user", "content": "Describe the sea in three sentences."}]
    full = await _chat(server, f"unstopped-{kind}", messages=messages, max_tokens=60, temperature=0)
    full_ids, full_text = full["choices"][0]["token_ids"], full["choices"][0]["message"]["content"]
    stop = _stop_case(full_text)

    session = f"stopped-{kind}"
    reply = await _chat(server, session, messages=messages, max_tokens=60, temperature=0, stop=[stop])
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == full_text[: full_text.index(stop)]
    # independently: the shortest run of vLLM's greedy tokens whose text holds the stop string
    tokenizer = _tokenizer(vllm_server)
    cut = next(k for k in range(1, len(full_ids) + 1) if stop in tokenizer.decode(full_ids[:k]))
    assert choice["token_ids"] == full_ids[:cut]
    (branch,) = _export(server, session)["branches"]
    start, end = branch["action_ranges"][0]
    assert branch["tokens"][start:end] == full_ids[:cut] and branch["finish_reasons"] == ["stop"]
    (exchange,) = recorder.generations(session)
    ids, values = sampled_by_vllm(exchange)
    assert ids[:cut] == full_ids[:cut] and branch["logprobs"][start:end] == values[:cut]


@pytest.mark.parametrize(
    "kind",
    [
        "vllm",
        "vllm-generate",
    ],
)
async def test_a_stop_string_stops_vllm(
    gateways: dict[str, RunningServer], proxy: Proxy, vllm_server: VLLMServer, kind: str
) -> None:
    server, (_, recorder) = gateways[kind], proxy
    messages = [{"role": "user", "content": "Describe the sea in three sentences."}]
    full = await _chat(server, f"unstopped-again-{kind}", messages=messages, max_tokens=60, temperature=0)
    full_ids, full_text = full["choices"][0]["token_ids"], full["choices"][0]["message"]["content"]
    stop = _stop_case(full_text)
    generated = vllm_server.metric("vllm:generation_tokens_total")
    session = f"stops-vllm-{kind}"
    reply = await _chat(server, session, messages=messages, max_tokens=60, temperature=0, stop=[stop])
    cut = len(reply["choices"][0]["token_ids"])
    assert cut < len(full_ids)
    made = await asyncio.wait_for(_settled_generation(vllm_server, generated), timeout=20)
    assert cut <= made < len(full_ids)  # vLLM stopped before the end of the reply it would have made
    (exchange,) = recorder.generations(session)
    assert not exchange.done  # vLLM's stream was closed before its end


# -- a client that leaves ------------------------------------------------------------------------------
async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)


async def _settled_generation(vllm_server: VLLMServer, before: float) -> float:
    """How many tokens vLLM generated since `before`, once it has stopped generating (vLLM does not
    count aborted requests in its finish reasons: its token counter and running gauge tell)."""
    made = -1.0
    while True:
        await asyncio.sleep(1.0)
        now = vllm_server.metric("vllm:generation_tokens_total") - before
        if now == made and vllm_server.metric("vllm:num_requests_running") == 0:
            return made
        made = now


async def _leave_early(server: RunningServer, session: str) -> int:
    """Stream a long greedy completion and leave after a few chunks (or 2 s without one).
    Returns how many content chunks arrived."""
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 1000, "temperature": 0, "stream": True}
    chunks = 0
    async with (
        httpx.AsyncClient(base_url=server.base_url, timeout=300) as http,
        http.stream("POST", f"/sessions/{session}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        started = time.monotonic()
        async for line in _lines_until(response, started + 2.0):
            chunks += line.startswith("data: {")
            if chunks >= 8:
                break
    return chunks


async def _lines_until(response: httpx.Response, deadline: float) -> Any:
    lines = response.aiter_lines()
    while (left := deadline - time.monotonic()) > 0:
        try:
            yield await asyncio.wait_for(anext(lines), timeout=left)
        except (TimeoutError, StopAsyncIteration):
            return


@pytest.mark.parametrize("kind", KINDS)
async def test_a_client_that_leaves_stops_vllm(
    gateways: dict[str, RunningServer], vllm_server: VLLMServer, kind: str
) -> None:
    generated = vllm_server.metric("vllm:generation_tokens_total")
    await _leave_early(gateways[kind], f"leaves-{kind}")
    made = await asyncio.wait_for(_settled_generation(vllm_server, generated), timeout=20)
    FIGURES[f"tokens vLLM generated for a client that left after 8 chunks or 2 s ({kind})"] = int(made)
    assert made < 250  # of the 1,000 allowed: it stopped when the client left


@pytest.mark.parametrize(
    "kind",
    [
        "vllm",
        "vllm-generate",
    ],
)
async def test_a_client_that_leaves_keeps_what_vllm_sampled(
    gateways: dict[str, RunningServer], proxy: Proxy, kind: str
) -> None:
    server, (_, recorder) = gateways[kind], proxy
    session = f"keeps-{kind}"
    await _leave_early(server, session)
    await _until(lambda: httpx.get(f"{server.base_url}/sessions/{session}", timeout=10).status_code == 200)
    await _until(lambda: _export(server, session)["branches"] != [])
    (branch,) = _export(server, session)["branches"]
    assert branch["finish_reasons"] == ["abort"]
    start, end = branch["action_ranges"][0]
    assert end > start
    (exchange,) = recorder.generations(session)
    ids, values = sampled_by_vllm(exchange)  # what vLLM sent before the stream was closed
    assert branch["tokens"][start:end] == ids[: end - start]
    assert branch["logprobs"][start:end] == values[: end - start]


# -- streaming ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind",
    [
        "vllm",
        "vllm-generate",
    ],
)
async def test_streamed_replies_arrive_while_vllm_generates(gateways: dict[str, RunningServer], kind: str) -> None:
    arrivals: list[float] = []
    async with _client(gateways[kind], f"streams-{kind}") as client:
        started = time.monotonic()
        stream = await client.completions.create(
            model=MODEL, prompt=COUNTING, max_tokens=64, temperature=0, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.monotonic() - started)
    assert len(arrivals) > 10
    assert arrivals[0] < arrivals[-1] / 3  # the first text came long before the last


# -- top_logprobs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
async def test_top_logprobs_are_the_most_likely_tokens_best_first(
    gateways: dict[str, RunningServer], vllm_server: VLLMServer, kind: str
) -> None:
    # a high temperature, so that some sampled tokens are not among the most likely
    sampling = {"max_tokens": 8, "temperature": 2.0, "seed": 5}
    messages = [{"role": "user", "content": "Hi"}]
    reply = await _chat(gateways[kind], f"top-{kind}", messages=messages, logprobs=True, top_logprobs=3, **sampling)
    content = reply["choices"][0]["logprobs"]["content"]
    # independently: vLLM's own answer to the same prompt and seed; its alternatives sorted by logprob
    direct = httpx.post(
        f"{vllm_server.url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": reply["prompt_token_ids"],
            "logprobs": 3,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **sampling,
        },
        timeout=300,
    ).json()["choices"][0]
    assert reply["choices"][0]["token_ids"] == direct["token_ids"]
    tops = [
        {int(t.removeprefix("token_id:")): lp for t, lp in top.items()} for top in direct["logprobs"]["top_logprobs"]
    ]
    expected = [sorted(top.items(), key=lambda pair: -pair[1])[:3] for top in tops]
    got = [[(alt["token_id"], alt["logprob"]) for alt in entry["top_logprobs"]] for entry in content]
    # the k best logprobs in order; tokens tied on a logprob may come in either order
    assert [[lp for _, lp in entry] for entry in got] == [[lp for _, lp in best] for best in expected]
    assert all(top[token] == lp for entry, top in zip(got, tops, strict=True) for token, lp in entry)
    # the case that matters was exercised: a sampled token outside the three most likely
    assert any(token not in [t for t, _ in best] for token, best in zip(direct["token_ids"], expected, strict=True))


async def test_logprobs_under_top_p_are_labelled_truncated(
    gateways: dict[str, RunningServer], vllm_server: VLLMServer
) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    reply = await _chat(gateways["vllm"], "top-p", messages=messages, max_tokens=1, temperature=1.0, top_p=0.5, seed=2)
    token = reply["choices"][0]["token_ids"][0]
    (branch,) = _export(gateways["vllm"], "top-p")["branches"]
    recorded = branch["logprobs"][len(reply["prompt_token_ids"])]
    # the same position without truncation: the token is in the 0.5 nucleus, so among the top 20
    untruncated = httpx.post(
        f"{vllm_server.url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": reply["prompt_token_ids"],
            "max_tokens": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "logprobs": 20,
            "return_tokens_as_token_ids": True,
        },
        timeout=300,
    ).json()["choices"][0]["logprobs"]["top_logprobs"][0][f"token_id:{token}"]
    # vLLM's processed_logprobs are renormalised over the 0.5 nucleus: not what a trainer recomputes
    # from logits / temperature, and the export says so for this turn
    assert recorded > untruncated + 0.05
    assert branch["logprob_modes"] == ["temperature_scaled_truncated"]


# -- throughput -----------------------------------------------------------------------------------------
async def test_tokens_per_second_through_the_gateway_against_direct(
    direct_gateway: RunningServer, vllm_server: VLLMServer
) -> None:
    """Figures, not a timed test: the same greedy generation through the gateway and straight to
    vLLM (the gateway's own prompt tokens), alternated; the tokens must be the same."""
    messages = [{"role": "user", "content": "Write the numbers from 1 to 100, separated by commas."}]
    async with httpx.AsyncClient(timeout=300) as http:

        async def through_gateway(session: str) -> tuple[list[int], list[int], float]:
            started = time.monotonic()
            response = await http.post(
                f"{direct_gateway.base_url}/sessions/{session}/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 128, "temperature": 0, "logprobs": True},
            )
            elapsed = time.monotonic() - started
            data = response.json()
            return data["prompt_token_ids"], data["choices"][0]["token_ids"], elapsed

        async def direct(prompt: list[int]) -> tuple[list[int], float]:
            started = time.monotonic()
            response = await http.post(
                f"{vllm_server.url}/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": 128,
                    "temperature": 0,
                    "logprobs": 0,
                    "return_token_ids": True,
                    "skip_special_tokens": False,
                },
            )
            elapsed = time.monotonic() - started
            return response.json()["choices"][0]["token_ids"], elapsed

        prompt, reference, _ = await through_gateway("warm-up")
        gateway_rates, direct_rates = [], []
        for round_ in range(3):
            _, ids, elapsed = await through_gateway(f"rate-{round_}")
            assert ids == reference
            gateway_rates.append(len(ids) / elapsed)
            ids, elapsed = await direct(prompt)
            assert ids == reference  # the same tokens either way
            direct_rates.append(len(ids) / elapsed)
    FIGURES["tokens per request"] = len(reference)
    FIGURES["tok/s through the gateway (median of 3)"] = round(statistics.median(gateway_rates), 1)
    FIGURES["tok/s straight to vLLM (median of 3)"] = round(statistics.median(direct_rates), 1)
    FIGURES["gateway / direct"] = round(statistics.median(gateway_rates) / statistics.median(direct_rates), 3)
    FIGURES["load average (1 min) when measured, on this many cores"] = f"{os.getloadavg()[0]:.1f} / {os.cpu_count()}"

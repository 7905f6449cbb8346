"""New weights on a real vLLM (CPU build) through the gateway: `tokentape serve --engine vllm=URL`,
a streamed turn running, `POST /admin/weights` with a LoRA adapter (PEFT layout, random B). The turn
goes on across the update as one reply; the tokens after the seam are vLLM's own greedy answer under
the adapter to prompt + the tokens sampled before it; the recorded spans say which version sampled
which tokens; later turns run under the adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.vllm.conftest import FIGURES, MODEL, VLLM_PYTHON, VLLMServer, _gateway
from tests.vllm.test_vllm_weights import _adapter
from tokentape.engines.remote.vllm import LORA_NAME

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="a real vLLM runs under `make e2e-vllm` only (minutes of CPU; not part of make test)"
    ),
    pytest.mark.timeout(900),
]

MAX_TOKENS = 48
SEAM_AFTER = 4  # streamed tokens the client has read when the trainer posts the update


def _vllm_greedy(server: VLLMServer, prompt: list[int], max_tokens: int) -> list[int]:
    """vLLM's own greedy continuation of `prompt` under the adapter, asked directly."""
    body = {"model": LORA_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    answer = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
    answer.raise_for_status()
    ids: list[int] = answer.json()["choices"][0]["token_ids"]
    return ids


async def _across(
    sdk: openai.AsyncOpenAI, http: httpx.AsyncClient, request: dict[str, Any], update: dict[str, Any]
) -> tuple[list[int], list[str], dict[str, Any]]:
    """One streamed turn, with `update` posted to /admin/weights once SEAM_AFTER tokens arrived: the
    token IDs the client received, its finish reasons and the update's answer."""
    received: list[int] = []
    finishes: list[str] = []
    report: dict[str, Any] | None = None
    async for chunk in await sdk.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            for item in choice.logprobs.content or [] if choice.logprobs else []:
                received.append(int(item.model_extra["token_id"]))
        if report is None and len(received) >= SEAM_AFTER:
            answer = await http.post("/admin/weights", json=update)
            assert answer.status_code == 200, answer.text
            report = answer.json()
    assert report is not None and report["status"]["weights_version"] == update["version"]
    return received, finishes, report


async def test_a_turn_goes_on_across_a_lora_update_on_vllm(vllm_lora_server: VLLMServer, tmp_path: Path) -> None:
    server = vllm_lora_server
    adapter = _adapter(tmp_path / "adapter", server.model_dir, seed=11)
    spec = f"vllm={server.url},logprobs-mode=processed_logprobs"
    with _gateway(spec, server.model_dir, tmp_path) as gateway:
        base = gateway.base_url
        sdk = openai.AsyncOpenAI(base_url=f"{base}/sessions/across/v1", api_key="x", max_retries=0)
        http = httpx.AsyncClient(base_url=base, timeout=300)
        try:
            request: dict[str, Any] = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Count from 1 to 100, separated by commas."}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "logprobs": True,
            }
            update = {"version": 1, "lora": str(adapter)}
            received, finishes, report = await _across(sdk, http, request, update)
            FIGURES["gateway LoRA update on vLLM, continue (s per phase)"] = report["phases"]
            assert finishes == ["length"] and len(received) == MAX_TOKENS  # one reply, nothing lost or doubled

            (branch,) = (await http.get("/sessions/across/export")).json()["branches"]
            (start, end) = branch["action_ranges"][0]
            assert branch["tokens"][start:end] == received  # what the client got is what was recorded
            (spans,) = branch["policy_spans"]
            assert [s["version"] for s in spans] == [0, 1], spans
            seam = spans[0]["end"]
            assert spans[0]["start"] == 0 and spans[1]["start"] == seam and spans[1]["end"] == MAX_TOKENS
            assert SEAM_AFTER <= seam < MAX_TOKENS
            assert branch["versions"][start:end] == [0] * seam + [1] * (MAX_TOKENS - seam)
            # after the seam: vLLM's own greedy answer under the adapter to prompt + the tokens before it
            prompt = branch["tokens"][:start]
            assert received[seam:] == _vllm_greedy(server, prompt + received[:seam], MAX_TOKENS - seam)

            # a turn begun after the update runs under the adapter from its first token
            after = openai.AsyncOpenAI(base_url=f"{base}/sessions/after/v1", api_key="x", max_retries=0)
            await after.chat.completions.create(**{**request, "max_tokens": 8})
            await after.close()
            (later,) = (await http.get("/sessions/after/export")).json()["branches"]
            (start, end) = later["action_ranges"][0]
            assert later["policy_spans"] == [[{"version": 1, "start": 0, "end": end - start}]]
            assert later["tokens"][start:end] == _vllm_greedy(server, later["tokens"][:start], end - start)

            # keep: the same turn shape; the engine's prefix cache is not dropped, and the span says the
            # tokens after the seam may run on KV of version 1 (vLLM swaps the adapter in place, one name)
            second = {"version": 2, "lora": str(_adapter(tmp_path / "second", server.model_dir, seed=12))}
            kept = openai.AsyncOpenAI(base_url=f"{base}/sessions/kept/v1", api_key="x", max_retries=0)
            received, finishes, report = await _across(kept, http, request, {**second, "in_flight": "keep"})
            await kept.close()
            FIGURES["gateway LoRA update on vLLM, keep (s per phase)"] = report["phases"]
            assert finishes == ["length"] and len(received) == MAX_TOKENS
            (branch,) = (await http.get("/sessions/kept/export")).json()["branches"]
            (spans,) = branch["policy_spans"]
            assert [(s["version"], s.get("kv_version")) for s in spans] == [(1, None), (2, 1)], spans
            seam = spans[0]["end"]
            prompt = branch["tokens"][: branch["action_ranges"][0][0]]
            fresh = _vllm_greedy(server, prompt + received[:seam], MAX_TOKENS - seam)
            FIGURES["vLLM keep: tokens after the seam equal a fresh-KV run"] = received[seam:] == fresh

            # abort: the running turn ends after its next token, finish reason abort, nothing resubmitted
            third = {"version": 3, "lora": str(_adapter(tmp_path / "third", server.model_dir, seed=13))}
            cut = openai.AsyncOpenAI(base_url=f"{base}/sessions/cut/v1", api_key="x", max_retries=0)
            received, finishes, report = await _across(cut, http, request, {**third, "in_flight": "abort"})
            await cut.close()
            assert finishes == ["abort"] and SEAM_AFTER <= len(received) < MAX_TOKENS
            (branch,) = (await http.get("/sessions/cut/export")).json()["branches"]
            assert [s["version"] for s in branch["policy_spans"][0]] == [2]
        finally:
            await sdk.close()
            await http.aclose()

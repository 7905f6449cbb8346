"""Remote engines over HTTP, token IDs in and out: vLLM (`/v1/completions` with a token-ID prompt and
`return_token_ids`, or its `/inference/v1/generate` token endpoint) and SGLang (`/generate` with
`input_ids`). Sampled token IDs and logprobs are read from the response, never from text.

Logprobs are what the server reports: start vLLM with `--logprobs-mode processed_logprobs` to get
temperature-scaled values like the embedded engine's (its default is the raw model distribution).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import httpx

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import SampledToken
from tokentape.errors import ContextOverflow, EngineFailure, InvalidRequest

__all__ = ["RemoteEngine", "VLLMEngine", "VLLMGenerateEngine", "SGLangEngine", "ENGINE_KINDS", "make_engine"]

SESSION_HEADER = "X-Session-ID"  # lets an engine-side router keep a session on its prefix cache


class RemoteEngine:
    """Shared plumbing: one HTTP client, health, load and error mapping."""

    kind = "remote"

    def __init__(
        self, base_url: str, *, model: str | None = None, context_length: int = 32768, timeout: float = 600.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_id = model or "default"
        self.context_length = context_length
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout)
        self.in_flight = 0
        self.healthy = True
        self.draining = False
        self.tokens_generated = 0

    async def discover(self) -> None:
        """Ask the server which model it serves (and its context length, where it says)."""
        try:
            models = (await self.http.get("/v1/models")).json()["data"]
        except (httpx.HTTPError, KeyError, ValueError):
            return
        if models:
            self.model_id = models[0].get("id", self.model_id)
            self.context_length = int(models[0].get("max_model_len") or self.context_length)

    async def check_health(self) -> bool:
        try:
            self.healthy = (await self.http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            self.healthy = False
        return self.healthy

    def generate(
        self, prompt: Sequence[int], params: SamplingParams, *, seed: int | None, session_id: str | None = None
    ) -> AsyncGenerator[SampledToken, None]:
        raise NotImplementedError  # each wire dialect below

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "url": self.base_url,
            "model": self.model_id,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "tokens_generated": self.tokens_generated,
        }

    @staticmethod
    def _raise_for(response: httpx.Response, body: bytes) -> None:
        if response.status_code < 400:
            return
        try:
            data = json.loads(body)
            message = (data.get("error") or {}).get("message") if isinstance(data.get("error"), dict) else None
            message = message or data.get("message") or data.get("error") or body.decode(errors="replace")
        except ValueError:
            message = body.decode(errors="replace")
        text = str(message)[:500]
        if response.status_code == 400 and ("context" in text.lower() or "too long" in text.lower()):
            raise ContextOverflow(f"the engine refused the prompt: {text}", param="messages")
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            raise InvalidRequest(f"the engine refused the request: {text}")
        raise EngineFailure(f"the engine answered {response.status_code}: {text}")

    async def _sse(self, path: str, body: dict[str, Any], session_id: str | None) -> AsyncIterator[dict[str, Any]]:
        headers = {SESSION_HEADER: session_id} if session_id else {}
        try:
            async with self.http.stream("POST", path, json=body, headers=headers) as response:
                if response.status_code >= 400:
                    self._raise_for(response, await response.aread())
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    event = json.loads(payload)
                    if "error" in event and not event.get("choices"):
                        raise EngineFailure(f"the engine reported an error: {event['error']}")
                    yield event
        except httpx.HTTPError as exc:
            raise EngineFailure(f"the engine at {self.base_url} failed: {exc!r}") from exc

    async def close(self) -> None:
        await self.http.aclose()


def _sampling_fields(prompt: Sequence[int], params: SamplingParams, context: int, *, length_key: str) -> dict[str, Any]:
    """The sampling fields vLLM and SGLang name alike; each adapter adds its own dialect's."""
    room = context - len(prompt)
    return {
        length_key: room if params.max_tokens is None else min(params.max_tokens, room),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,  # -1 is "off" on both
        "min_p": params.min_p,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,  # stop tokens were sampled: their text stays
    }


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def _entry_token(entry: dict[str, Any]) -> int:
    """/inference/v1/generate names a top_logprobs token as `token_id: N` (0.32); `token: "token_id:N"`
    is the /v1/chat/completions spelling."""
    return int(entry["token_id"]) if "token_id" in entry else _token_id(entry["token"])


def _best_first(alternatives: Sequence[tuple[int, float]], k: int) -> tuple[tuple[int, float], ...]:
    """The `k` most likely tokens, best first. vLLM lists the sampled token first whether or not it
    is among them (`/v1/completions` then sends k + 1 entries)."""
    return tuple(sorted(alternatives, key=lambda pair: -pair[1])[:k])


class VLLMEngine(RemoteEngine):
    """vLLM's OpenAI server: `/v1/completions`, streamed, prompt as token IDs."""

    kind = "vllm"

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, *, seed: int | None, session_id: str | None = None
    ) -> AsyncGenerator[SampledToken, None]:
        body: dict[str, Any] = {
            "model": self.model_id,
            "prompt": list(prompt),
            **_sampling_fields(prompt, params, self.context_length, length_key="max_tokens"),
            "stream": True,
            "logprobs": params.top_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed % 2**63
        async for event in self._sse("/v1/completions", body, session_id):
            for choice in event.get("choices", []):
                logprobs = choice.get("logprobs") or {}
                ids = choice.get("token_ids") or [_token_id(t) for t in logprobs.get("tokens") or []]
                values = logprobs.get("token_logprobs") or []
                tops = logprobs.get("top_logprobs") or [None] * len(ids)
                if len(values) != len(ids):
                    raise EngineFailure("the engine sent token IDs without one logprob each")
                for token, logprob, top in zip(ids, values, tops, strict=True):
                    self.tokens_generated += 1
                    alternatives = [(_token_id(t), float(lp)) for t, lp in (top or {}).items()]
                    yield SampledToken(int(token), float(logprob), _best_first(alternatives, params.top_logprobs))


class VLLMGenerateEngine(RemoteEngine):
    """vLLM's token endpoint `/inference/v1/generate` (token IDs in, token IDs out; one response)."""

    kind = "vllm-generate"

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, *, seed: int | None, session_id: str | None = None
    ) -> AsyncGenerator[SampledToken, None]:
        sampling: dict[str, Any] = {
            **_sampling_fields(prompt, params, self.context_length, length_key="max_tokens"),
            # vLLM lists the sampled token first and cuts the list at `logprobs` entries: one more
            # than asked keeps the k best whether or not the sampled token is among them
            "logprobs": params.top_logprobs + 1,
        }
        if seed is not None:
            sampling["seed"] = seed % 2**63
        body = {"model": self.model_id, "token_ids": list(prompt), "sampling_params": sampling, "stream": False}
        headers = {SESSION_HEADER: session_id} if session_id else {}
        try:
            response = await self.http.post("/inference/v1/generate", json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise EngineFailure(f"the engine at {self.base_url} failed: {exc!r}") from exc
        self._raise_for(response, response.content)
        for choice in response.json().get("choices", [])[:1]:
            ids = choice.get("token_ids") or []
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(ids):
                raise EngineFailure("the engine sent token IDs without one logprob each")
            for token, entry in zip(ids, content, strict=True):
                self.tokens_generated += 1
                alternatives = [(_entry_token(t), float(t["logprob"])) for t in entry.get("top_logprobs") or []]
                yield SampledToken(int(token), float(entry["logprob"]), _best_first(alternatives, params.top_logprobs))


class SGLangEngine(RemoteEngine):
    """SGLang's native `/generate`, streamed, with `input_ids` and `return_logprob`."""

    kind = "sglang"

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, *, seed: int | None, session_id: str | None = None
    ) -> AsyncGenerator[SampledToken, None]:
        rid = uuid.uuid4().hex
        sampling: dict[str, Any] = {
            **_sampling_fields(prompt, params, self.context_length, length_key="max_new_tokens"),
            "no_stop_trim": True,  # keep the stop token in the output: it was sampled
        }
        if seed is not None:
            sampling["sampling_seed"] = seed % 2**31
        body = {
            "input_ids": list(prompt),
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": params.top_logprobs,
            "stream": True,
            "rid": rid,
        }
        seen = 0
        finished = False
        try:
            async for event in self._sse("/generate", body, session_id):
                meta = event.get("meta_info") or {}
                entries = meta.get("output_token_logprobs") or []
                tops = meta.get("output_top_logprobs") or []
                # SGLang streams cumulative output by default: each event repeats what came before
                for k in range(seen, len(entries)):
                    logprob, token = entries[k][0], entries[k][1]
                    self.tokens_generated += 1
                    top = tops[k] if k < len(tops) and tops[k] else []
                    yield SampledToken(int(token), float(logprob), tuple((int(t[1]), float(t[0])) for t in top))
                seen = max(seen, len(entries))
                finished = meta.get("finish_reason") is not None
        finally:
            if not finished:  # the caller left early: free the engine's slot now
                with contextlib.suppress(httpx.HTTPError):
                    await self.http.post("/abort_request", json={"rid": rid}, timeout=5.0)


ENGINE_KINDS: dict[str, type[RemoteEngine]] = {
    "vllm": VLLMEngine,
    "vllm-generate": VLLMGenerateEngine,
    "sglang": SGLangEngine,
}


def make_engine(spec: str) -> RemoteEngine:
    """`kind=url`, e.g. `vllm=http://10.0.0.5:8000`."""
    kind, sep, url = spec.partition("=")
    if not sep or kind not in ENGINE_KINDS or not url.startswith(("http://", "https://")):
        raise InvalidRequest(
            f"engines are given as KIND=URL with KIND one of {', '.join(ENGINE_KINDS)}", param="engine"
        )
    return ENGINE_KINDS[kind](url)

"""top_k in one convention end to end: a request says "off" as -1, 0 or nothing (vLLM's rule), the
gateway holds 0 for off (`SamplingParams.top_k`, what a turn records), and each engine is handed its
own: the embedded engine's sampler 0, vLLM's and SGLang's wire -1. Checked at both edges: what each
route hands the engine, and what a remote engine is sent over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.support.fake_engines import FakeState, serving, sglang_app, vllm_app
from tests.support.served import build
from tokentape.core.sampling import SamplingParams
from tokentape.engines.remote import SGLangEngine, VLLMEngine, VLLMGenerateEngine
from tokentape.engines.remote.client import RemoteEngine
from tokentape.engines.router import Router
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer

VOCAB = 49152  # the test model's vocabulary
ABSENT = object()
# a request's top_k -> the gateway's (what the engine is handed) and vLLM's / SGLang's on their wire
EDGES: list[tuple[Any, int, int]] = [
    (ABSENT, 0, -1),
    (-1, 0, -1),
    (0, 0, -1),
    (1, 1, 1),
    (40, 40, 40),
    (VOCAB, VOCAB, VOCAB),  # at the vocabulary's size: cuts nothing, handed on as asked
    (2**62, 2**62, 2**62),
]
EDGE_IDS = ["absent", "minus-one", "zero", "one", "forty", "vocab", "huge"]


def _bodies(top_k: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """One request on each route that takes top_k, with `top_k` where it belongs (none: ABSENT)."""
    field = {} if top_k is ABSENT else {"top_k": top_k}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **field}
    return {
        "chat": ("/v1/chat/completions", chat),
        "completions": ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, **field}),
        "messages": ("/v1/messages", chat),
        "generate": ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, **field}}),
    }


@pytest.fixture
async def handed(renderer: Renderer) -> AsyncIterator[tuple[httpx.AsyncClient, list[SamplingParams]]]:
    """A gateway whose engine keeps the sampling parameters of every generation it is asked."""
    asked: list[SamplingParams] = []

    class Recording(ScriptedEngine):
        def generate(self, prompt: Any, params: SamplingParams, *, seed: int | None, **options: Any) -> Any:
            asked.append(params)
            return super().generate(prompt, params, seed=seed, **options)

    engine = Recording(renderer.tokenizer.encode("Fine."), renderer.tokenizer.encode("<|im_end|>")[0])
    built = build(engine, renderer)
    gateway, app = built.gateway, built.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        yield http, asked
    await gateway.aclose()


@pytest.mark.parametrize(("top_k", "held", "_wire"), EDGES, ids=EDGE_IDS)
async def test_every_route_hands_the_engine_one_convention(
    handed: tuple[httpx.AsyncClient, list[SamplingParams]], top_k: Any, held: int, _wire: int
) -> None:
    http, asked = handed
    for route, (path, body) in _bodies(top_k).items():
        response = await http.post(path, json=body)
        assert response.status_code == 200, (route, response.text)
        assert asked.pop().top_k == held, route
    assert asked == []


async def test_the_turn_records_the_gateways_convention(
    handed: tuple[httpx.AsyncClient, list[SamplingParams]],
) -> None:
    http, _ = handed
    _, body = _bodies(-1)["chat"]
    assert (await http.post("/sessions/off/v1/chat/completions", json=body)).status_code == 200
    exported = (await http.get("/sessions/off/export")).json()
    assert [sampling["top_k"] for sampling in exported["branches"][0]["sampling"]] == [0]


@pytest.mark.parametrize("top_k", [-2, -5, -(2**62)])
async def test_below_minus_one_is_refused_on_every_route_by_its_own_name(
    handed: tuple[httpx.AsyncClient, list[SamplingParams]], top_k: int
) -> None:
    http, asked = handed
    for route, (path, body) in _bodies(top_k).items():
        response = await http.post(path, json=body)
        assert response.status_code == 400, (route, response.text)
        error = response.json().get("error") or response.json()
        assert str(top_k) in error["message"], (route, error)
        if route != "messages":  # Anthropic's error shape names no parameter
            assert error["param"] == ("sampling_params.top_k" if route == "generate" else "top_k"), (route, error)
    assert asked == []


def _remote(kind: str, url: str) -> RemoteEngine:
    engines: dict[str, type[RemoteEngine]] = {
        "vllm": VLLMEngine,
        "vllm-generate": VLLMGenerateEngine,
        "sglang": SGLangEngine,
    }
    return engines[kind](url)


def _sent_top_k(kind: str, body: dict[str, Any]) -> Any:
    return body["top_k"] if kind == "vllm" else body["sampling_params"]["top_k"]


@pytest.mark.parametrize("kind", ["vllm", "vllm-generate", "sglang"])
async def test_each_remote_engine_is_sent_its_own_off(renderer: Renderer, kind: str) -> None:
    state = FakeState()
    app_of = sglang_app if kind == "sglang" else vllm_app
    with serving(app_of(state)) as url:
        built = build(Router([_remote(kind, url)], vocab_size=VOCAB), renderer)
        gateway, app = built.gateway, built.app
        await gateway.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            for top_k, _held, wire in EDGES:
                _, body = _bodies(top_k)["chat"]
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                assert _sent_top_k(kind, state.requests[-1]) == wire, (top_k, state.requests[-1])
        await gateway.aclose()


@pytest.mark.parametrize(("held", "wire"), [(held, wire) for _, held, wire in EDGES], ids=EDGE_IDS)
def test_vllm_under_openrlhf_is_given_its_own_off(held: int, wire: int) -> None:
    from tokentape.integrations.openrlhf import VLLMEngine as OpenRLHFEngine

    trainers = SimpleNamespace(n=4, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, max_tokens=64)
    engine = OpenRLHFEngine(
        None, trainers, context_length=4096, model_id=MODEL_NAME, end_of_turn_ids=frozenset({VOCAB - 1})
    )
    params = SamplingParams(top_k=held)
    assert engine.vllm_params(8, params, seed=None).top_k == wire
    assert trainers.top_k == -1  # the trainer's own stays as it was: each call gets a copy

"""Remote engine adapters against local servers speaking vLLM's and SGLang's wire formats."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from tests.support.fake_engines import END_OF_TURN, FakeState, script, serving, sglang_app, vllm_app
from tokentape.core.sampling import SamplingParams
from tokentape.engines.remote import RemoteEngine, SGLangEngine, VLLMEngine, VLLMGenerateEngine, make_engine
from tokentape.errors import ContextOverflow, EngineFailure, InvalidRequest

PROMPT = [1, 4093, 198, 19556, 2]
ADAPTERS = [
    ("vllm", VLLMEngine, vllm_app),
    ("vllm-generate", VLLMGenerateEngine, vllm_app),
    ("sglang", SGLangEngine, sglang_app),
]


@pytest.fixture(params=ADAPTERS, ids=[a[0] for a in ADAPTERS])
def remote(request: pytest.FixtureRequest) -> Iterator[tuple[RemoteEngine, FakeState]]:
    kind, cls, app = request.param
    state = FakeState()
    with serving(app(state)) as url:
        engine = cls(url)
        assert engine.kind == kind
        yield engine, state


async def _run(engine: RemoteEngine, params: SamplingParams, seed: int | None = 3) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) async for t in engine.generate(PROMPT, params, seed=seed, session_id="s-1")]


async def test_tokens_and_logprobs_come_from_the_response(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, state = remote
    await engine.discover()
    assert (engine.model_id, engine.context_length) == ("fake-model", 4096)
    got = await _run(engine, SamplingParams(max_tokens=100, temperature=0.7, top_logprobs=1, logprobs=True))
    assert got == script(PROMPT, 3)
    assert got[-1][0] == END_OF_TURN
    sent = state.requests[-1]
    assert state.session_headers[-1] == "s-1"
    if engine.kind == "sglang":
        assert sent["input_ids"] == PROMPT and sent["return_logprob"] is True and sent["stream"] is True
        assert sent["sampling_params"]["no_stop_trim"] is True
    elif engine.kind == "vllm":
        assert sent["prompt"] == PROMPT and sent["return_token_ids"] is True and sent["stream"] is True
        assert sent["seed"] == 3 and sent["temperature"] == 0.7
    else:
        assert sent["token_ids"] == PROMPT and sent["sampling_params"]["logprobs"] >= 1


async def test_truncation_and_stop_tokens(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, _ = remote
    truncated = await _run(engine, SamplingParams(max_tokens=4))
    assert truncated == script(PROMPT, 3)[:4]
    stop_at = script(PROMPT, 3)[2][0]
    stopped = await _run(engine, SamplingParams(max_tokens=100, stop_token_ids=(stop_at,)))
    assert stopped == script(PROMPT, 3)[:3]  # the stop token was sampled: it is kept


async def test_upstream_errors_map_to_the_error_tree(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, state = remote
    state.fail_next = 1
    with pytest.raises(EngineFailure):
        await _run(engine, SamplingParams(max_tokens=4))
    if engine.kind == "vllm":
        with pytest.raises(ContextOverflow):
            await _run(engine, SamplingParams(max_tokens=5000))


async def test_closing_early_aborts_upstream(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, state = remote
    if engine.kind == "vllm-generate":
        pytest.skip("the token endpoint answers in one piece: there is nothing to abort midway")
    state.delay = 0.05
    stream = engine.generate(PROMPT, SamplingParams(max_tokens=100), seed=1)
    async with contextlib.aclosing(stream):
        async for _ in stream:
            break
    for _ in range(100):
        if state.aborted:
            break
        await asyncio.sleep(0.05)
    assert state.aborted == 1


def test_engine_specs_are_checked() -> None:
    assert isinstance(make_engine("sglang=http://127.0.0.1:30000"), SGLangEngine)
    for bad in ("vllm", "tgi=http://x", "vllm=ftp://x"):
        with pytest.raises(InvalidRequest):
            make_engine(bad)

"""Remote engine adapters against local stand-ins speaking vLLM's and SGLang's wire formats
(tests/support/fake_engines.py: a test instrument, not a model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import anyio
import pytest

from tests.support.fake_engines import (
    END_OF_TURN,
    FakeState,
    SwappableApp,
    alternatives,
    script,
    serving,
    sglang_app,
    vllm_app,
)
from tokentape.core.sampling import SamplingParams
from tokentape.engines import router as router_module
from tokentape.engines.base import Constraint, SampledToken, came_together
from tokentape.engines.remote import RemoteEngine, SGLangEngine, VLLMEngine, VLLMGenerateEngine, make_engine
from tokentape.engines.remote import client as remote_client
from tokentape.engines.remote.client import EngineAnswered, mapped
from tokentape.engines.router import Router
from tokentape.errors import (
    ContextOverflow,
    EngineFailure,
    EngineProtocolError,
    EngineUnavailable,
    InvalidRequest,
)

PROMPT = [1, 4093, 198, 19556, 2]
ADAPTERS = [
    ("vllm", VLLMEngine, vllm_app),
    ("vllm-generate", VLLMGenerateEngine, vllm_app),
    ("sglang", SGLangEngine, sglang_app),
]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[SwappableApp, str]]]:
    with contextlib.ExitStack() as stack:
        shared: dict[str, tuple[SwappableApp, str]] = {}
        for kind, _, _ in ADAPTERS:
            current = SwappableApp()
            shared[kind] = current, stack.enter_context(serving(current, lifespan="off"))
        yield shared


@contextlib.contextmanager
def vllm_serving(servers: dict[str, tuple[SwappableApp, str]], state: FakeState) -> Iterator[str]:
    """A fresh vLLM stand-in on `state`, on the module's vLLM server: its address."""
    current, url = servers["vllm"]
    current.app = vllm_app(state)
    yield url


@pytest.fixture(params=ADAPTERS, ids=[a[0] for a in ADAPTERS])
async def remote(
    request: pytest.FixtureRequest, servers: dict[str, tuple[SwappableApp, str]]
) -> AsyncIterator[tuple[RemoteEngine, FakeState]]:
    kind, cls, app = request.param
    state = FakeState()
    current, url = servers[kind]
    current.app = app(state)
    engine = cls(url)
    assert engine.kind == kind
    yield engine, state
    await engine.close()  # its connections to the shared server go with it


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether `condition` came true within `timeout` seconds (polled; the caller asserts it)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def _run(
    engine: RemoteEngine,
    params: SamplingParams,
    seed: int | None = 3,
    session_id: str | None = "s-1",
    *,
    whole: bool = False,
) -> list[tuple[int, float]]:
    stream = engine.generate(PROMPT, params, seed=seed, session_id=session_id, whole=whole)
    return [(t.token_id, t.logprob) async for t in stream]


# streamed, and in one answer (for a caller that reads only the result)
WHOLE = pytest.mark.parametrize("whole", [False, True], ids=["streamed", "whole"])


@WHOLE
async def test_tokens_and_logprobs_come_from_the_response(remote: tuple[RemoteEngine, FakeState], whole: bool) -> None:
    engine, state = remote
    await engine.discover()
    assert (engine.model_id, engine.context_length) == ("fake-model", 4096)
    params = SamplingParams(max_tokens=100, temperature=0.7, top_logprobs=1, logprobs=True)
    got = await _run(engine, params, whole=whole)
    assert got == script(PROMPT, 3)
    assert got[-1][0] == END_OF_TURN
    sent = state.requests[-1]
    assert state.session_headers[-1] == "s-1"
    assert sent["stream"] is not whole
    if engine.kind == "sglang":
        assert sent["input_ids"] == PROMPT and sent["return_logprob"] is True
        assert sent["sampling_params"]["no_stop_trim"] is True
    elif engine.kind == "vllm":
        assert sent["prompt"] == PROMPT and sent["return_tokens_as_token_ids"] is True
        assert "return_token_ids" not in sent  # vLLM would echo the whole prompt's IDs with every answer
        assert sent["seed"] == 3 and sent["temperature"] == 0.7
    else:
        assert sent["token_ids"] == PROMPT and sent["sampling_params"]["logprobs"] >= 1


@pytest.mark.parametrize("arrival", ["together", "one at a time", "whole"])
async def test_tokens_read_together_are_marked_as_followed(
    remote: tuple[RemoteEngine, FakeState], arrival: str
) -> None:
    """A stream passes the text of tokens that came together on as one (gateway/generation.py): a token
    is marked as followed exactly when the next one was read with it, never when it came alone."""
    engine, state = remote
    taken = 0
    if arrival == "together":
        state.burst = True  # every event and the end in one write
    elif arrival == "one at a time":

        async def once_the_last_was_taken(index: int) -> None:  # event `index` waits for token index - 1
            deadline = asyncio.get_running_loop().time() + 10
            while taken < index:
                assert asyncio.get_running_loop().time() < deadline, "the caller never took the last token"
                await asyncio.sleep(0.002)

        state.before_event = once_the_last_was_taken
    params = SamplingParams(max_tokens=100, logprobs=True)
    follows: list[bool] = []
    async for token in engine.generate(PROMPT, params, seed=3, whole=arrival == "whole"):
        follows.append(token.follows)
        taken += 1
    expected = script(PROMPT, 3)
    assert len(follows) == len(expected)
    if arrival == "together":  # the last one ends the answer: nothing follows it
        assert follows == [True] * (len(expected) - 1) + [False]
    else:
        assert follows == [False] * len(expected)


@WHOLE
async def test_top_logprobs_are_the_most_likely_best_first(remote: tuple[RemoteEngine, FakeState], whole: bool) -> None:
    # vLLM lists the sampled token first whatever its rank; the adapter must report the k most likely
    engine, _ = remote
    params = SamplingParams(max_tokens=100, top_logprobs=3, logprobs=True)
    tokens = [t async for t in engine.generate(PROMPT, params, seed=3, whole=whole)]
    assert len(tokens) == len(script(PROMPT, 3))
    for token, (sampled, logprob) in zip(tokens, script(PROMPT, 3), strict=True):
        assert list(token.top_logprobs) == alternatives(sampled, logprob, 3)
    # the case that matters: somewhere the sampled token is not the most likely one
    assert any(t.top_logprobs[0][0] != t.token_id for t in tokens)


@WHOLE
async def test_truncation_and_stop_tokens(remote: tuple[RemoteEngine, FakeState], whole: bool) -> None:
    engine, _ = remote
    truncated = await _run(engine, SamplingParams(max_tokens=4), whole=whole)
    assert truncated == script(PROMPT, 3)[:4]
    stop_at = script(PROMPT, 3)[2][0]
    stopped = await _run(engine, SamplingParams(max_tokens=100, stop_token_ids=(stop_at,)), whole=whole)
    assert stopped == script(PROMPT, 3)[:3]  # the stop token was sampled: it is kept


@WHOLE
async def test_upstream_errors_map_to_the_error_tree(remote: tuple[RemoteEngine, FakeState], whole: bool) -> None:
    engine, state = remote
    state.fail_next = 1
    with pytest.raises(EngineFailure) as failure:
        await _run(engine, SamplingParams(max_tokens=4), whole=whole)
    assert failure.value.engine_down and failure.value.status == 502
    assert "died" in failure.value.message  # the engine's words
    if engine.kind == "vllm":
        with pytest.raises(ContextOverflow):
            await _run(engine, SamplingParams(max_tokens=5000), whole=whole)


async def test_closing_early_aborts_upstream(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, state = remote
    state.delay = 0.05
    stream = engine.generate(PROMPT, SamplingParams(max_tokens=100), seed=1)
    async with contextlib.aclosing(stream):
        async for _ in stream:
            break
    assert await until(lambda: state.aborted == 1)
    # an answer asked for in one piece: cancelled while the engine is still generating it
    task = asyncio.ensure_future(_run(engine, SamplingParams(max_tokens=100), whole=True))
    assert await until(lambda: len(state.requests) == 2)  # the engine has it
    assert state.requests[-1]["stream"] is False and not task.done()  # and is still generating it
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await until(lambda: state.aborted == 2)


async def test_finished_generations_reuse_one_connection(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, state = remote
    for _ in range(20):
        # the caller stops at the end-of-turn token, before the stream's `[DONE]`, as the gateway does
        async for token in engine.generate(PROMPT, SamplingParams(max_tokens=100), seed=1):
            if token.token_id == END_OF_TURN:
                break
    assert len(state.requests) == 20
    assert len(state.peers) == 1  # one TCP connection for all twenty


async def test_cancelled_generations_release_their_connections(remote: tuple[RemoteEngine, FakeState]) -> None:
    """Cancelled by plain task cancellation and inside an anyio cancel scope (as Starlette cancels a
    streaming response whose client left), at every point of the exchange: no pool slot is lost, so a
    pool of four still carries four generations at once afterwards."""
    engine, state = remote
    engine = type(engine)(engine.base_url, max_connections=4)
    state.delay = 0.002

    async def consume() -> None:
        async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=100), seed=1):
            pass

    for i in range(200):
        if i % 4:
            task = asyncio.ensure_future(consume())
            await asyncio.sleep((i % 50) * 0.0005)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        else:
            with anyio.move_on_after((i % 50) * 0.0005):
                await consume()
    state.delay = 1.0
    sent = len(state.requests)
    slow = [asyncio.ensure_future(consume()) for _ in range(4)]
    # a lost slot keeps one of them waiting for the pool
    assert await until(lambda: len(state.requests) - sent == 4, timeout=2.0)
    for task in slow:
        task.cancel()
    await asyncio.gather(*slow, return_exceptions=True)
    assert await engine.check_health()
    await engine.close()


async def test_health_is_probed_on_its_own_connection(servers: dict[str, tuple[SwappableApp, str]]) -> None:
    state = FakeState(delay=0.2)
    with vllm_serving(servers, state) as url:
        engine = VLLMEngine(url, max_connections=2)
        busy = [asyncio.ensure_future(_run(engine, SamplingParams(max_tokens=100))) for _ in range(4)]
        # the generation pool is full (two at the engine, each ~2.6 s long), two more wait for it
        assert await until(lambda: len(state.requests) == 2)
        assert not any(task.done() for task in busy)
        assert await asyncio.wait_for(engine.check_health(), 2.0)
        state.healthy = False
        assert not await asyncio.wait_for(engine.check_health(), 2.0)
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        await engine.close()


async def test_a_session_id_that_is_no_header_value_is_sent_quoted(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, state = remote
    got = await _run(engine, SamplingParams(max_tokens=3), session_id="abc\n")
    assert got == script(PROMPT, 3)[:3]
    assert state.session_headers[-1] == "abc%0A"


async def test_only_the_engines_own_failures_take_it_out_of_rotation(
    monkeypatch: pytest.MonkeyPatch, servers: dict[str, tuple[SwappableApp, str]]
) -> None:
    # the on-demand re-probe's spacing, shortened: that a probe waits for it is checked, not its length
    monkeypatch.setattr(router_module, "REPROBE_INTERVAL", 0.2)
    state = FakeState()
    with vllm_serving(servers, state) as url:
        router = Router([VLLMEngine(url)])
        (engine,) = router.engines

        async def turn(params: SamplingParams) -> None:
            async for _ in router.generate(PROMPT, params, seed=1, session_id="s"):
                pass

        with pytest.raises(ContextOverflow):  # a 4xx about this request
            await turn(SamplingParams(max_tokens=5000))
        assert engine.healthy
        state.mangle = lambda i, event: b"{not json"
        with pytest.raises(EngineProtocolError):  # malformed: the request fails, the engine stays
            await turn(SamplingParams(max_tokens=5))
        assert engine.healthy
        state.mangle = None
        state.fail_next = 1
        with pytest.raises(EngineFailure):  # a 5xx: the engine's failure
            await turn(SamplingParams(max_tokens=5))
        assert not engine.healthy
        # no engine in rotation: it is probed at once, found healthy, and serves
        await turn(SamplingParams(max_tokens=5))
        assert engine.healthy
        state.healthy = False
        state.fail_next = 1
        with pytest.raises(EngineFailure):
            await turn(SamplingParams(max_tokens=5))
        await asyncio.sleep(0.3)  # past the re-probe interval: the probe says 503, so 503 here
        with pytest.raises(EngineUnavailable) as unavailable:
            await turn(SamplingParams(max_tokens=5))
        assert unavailable.value.status == 503 and unavailable.value.retry_after == router.health_interval
        await router.close()


async def test_token_ids_outside_the_vocabulary_are_protocol_faults(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, _ = remote
    engine.vocab_size = 1000  # the script samples IDs from 300 to 30300
    with pytest.raises(EngineProtocolError, match="not a token of this model"):
        await _run(engine, SamplingParams(max_tokens=5))


def _respelled(rename: Callable[[int], object]) -> Callable[[int, dict[str, Any]], bytes]:
    """A completions event whose `tokens` name each of its `token_ids` as `rename` says."""

    def mangle(_: int, event: dict[str, Any]) -> bytes:
        for choice in event["choices"]:
            choice["logprobs"]["tokens"] = [rename(t) for t in choice["token_ids"]]
        return json.dumps(event).encode()

    return mangle


@WHOLE
async def test_token_ids_and_the_tokens_they_name_must_agree(
    whole: bool, servers: dict[str, tuple[SwappableApp, str]]
) -> None:
    """IDs come from the logprobs' tokens; a server that sends `token_ids` as well must agree with them."""
    state = FakeState(token_ids_unasked=True)
    with vllm_serving(servers, state) as url:
        engine = VLLMEngine(url)
        params = SamplingParams(max_tokens=5)
        expected = await _run(engine, params, whole=whole)
        state.mangle = _respelled(lambda t: f"token_id:{t:05d}")  # spelled with zeros: the same IDs
        assert await _run(engine, params, whole=whole) == expected
        state.mangle = _respelled(lambda t: f"token_id:{t + 1}")
        with pytest.raises(EngineProtocolError, match="differ"):
            await _run(engine, params, whole=whole)
        state.mangle = _respelled(lambda t: f"{t}")
        with pytest.raises(EngineProtocolError, match="not `token_id:N`"):
            await _run(engine, params, whole=whole)
        await engine.close()


@pytest.mark.parametrize(
    ("kind", "mode", "params", "expected"),
    [
        # the embedded engine's own formula is checked in test_llamacpp; these follow the engines' sources
        ("vllm", None, SamplingParams(temperature=0.7), "raw"),  # raw_logprobs ignore temperature
        ("vllm", None, SamplingParams(temperature=1.0, top_p=0.5), "temperature_scaled_untruncated"),
        ("vllm", None, SamplingParams(temperature=0.0), "raw"),
        ("vllm", "processed_logprobs", SamplingParams(temperature=0.7), "temperature_scaled_untruncated"),
        ("vllm", "processed_logprobs", SamplingParams(temperature=0.7, top_p=0.5), "temperature_scaled_truncated"),
        ("vllm", "processed_logprobs", SamplingParams(temperature=0.7, top_k=5), "temperature_scaled_truncated"),
        ("vllm", "processed_logprobs", SamplingParams(temperature=0.7, min_p=0.1), "temperature_scaled_truncated"),
        ("vllm-generate", "processed_logprobs", SamplingParams(temperature=0.0, top_p=0.5), "raw"),
        ("sglang", None, SamplingParams(temperature=0.7), "temperature_scaled_untruncated"),
        ("sglang", None, SamplingParams(temperature=0.7, top_p=0.9), "temperature_scaled_truncated"),
        ("sglang", None, SamplingParams(temperature=0.7, top_k=5), "temperature_scaled_untruncated"),  # top-k not
        ("sglang", "original", SamplingParams(temperature=0.7, top_p=0.9), "raw"),
        ("sglang", None, SamplingParams(temperature=0.0), "raw"),
    ],
)
def test_logprob_mode_follows_engine_and_sampling(
    kind: str, mode: str | None, params: SamplingParams, expected: str
) -> None:
    spec = f"{kind}=http://127.0.0.1:1" + (f",logprobs-mode={mode}" if mode else "")
    assert make_engine(spec).logprob_mode(params) == expected


async def test_each_generation_reports_its_logprob_mode(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, _ = remote
    params = SamplingParams(max_tokens=3, temperature=0.5)
    modes = {t.logprob_mode async for t in engine.generate(PROMPT, params, seed=1)}
    assert modes == {"raw" if engine.kind.startswith("vllm") else "temperature_scaled_untruncated"}


@pytest.mark.parametrize(
    ("constraint", "vllm_field", "sglang_field"),
    [
        (
            Constraint("json_schema", '{"type": "object"}'),
            {"json": {"type": "object"}},
            ("json_schema", '{"type": "object"}'),
        ),
        (Constraint("regex", "[0-9]+"), {"regex": "[0-9]+"}, ("regex", "[0-9]+")),
        (Constraint("grammar", 'root ::= "a"'), {"grammar": 'root ::= "a"'}, ("ebnf", 'root ::= "a"')),
    ],
)
async def test_constraints_map_to_each_engines_fields(
    remote: tuple[RemoteEngine, FakeState], constraint: Constraint, vllm_field: object, sglang_field: tuple[str, str]
) -> None:
    engine, state = remote
    async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=2), seed=1, constraint=constraint):
        pass
    sent = state.requests[-1]
    if engine.kind == "vllm":
        assert sent["structured_outputs"] == vllm_field
    elif engine.kind == "vllm-generate":
        assert sent["sampling_params"]["structured_outputs"] == vllm_field
    else:
        name, value = sglang_field
        assert sent["sampling_params"][name] == value


async def test_a_constraint_that_is_not_valid_is_the_requests_error(remote: tuple[RemoteEngine, FakeState]) -> None:
    engine, state = remote
    if engine.kind == "sglang":
        pytest.skip("SGLang takes the schema as text and checks it itself")
    with pytest.raises(InvalidRequest, match="not JSON"):
        async for _ in engine.generate(
            PROMPT, SamplingParams(max_tokens=2), seed=1, constraint=Constraint("json_schema", "{")
        ):
            pass
    assert state.requests == []  # nothing was sent


def test_engine_specs_are_checked() -> None:
    assert isinstance(make_engine("sglang=http://127.0.0.1:30000"), SGLangEngine)
    engine = make_engine("vllm=http://127.0.0.1:8000,logprobs-mode=processed_logprobs")
    assert engine.logprobs_mode == "processed_logprobs" and engine.base_url == "http://127.0.0.1:8000"
    for bad in ("vllm", "tgi=http://x", "vllm=ftp://x", "vllm=http://x,logprobs-mode=odd", "vllm=http://x,mode=raw"):
        with pytest.raises(InvalidRequest):
            make_engine(bad)


URL = "http://127.0.0.1:1"


@pytest.mark.parametrize(
    ("raised", "sending", "expected", "engine_down"),
    [
        # answers with an error status, quoted in the engine's words
        (EngineAnswered.from_body(503, b'{"object": "error", "message": "KV cache full"}'), False, EngineFailure, True),
        (EngineAnswered.from_body(500, b"plain text: KV cache full"), False, EngineFailure, True),
        (EngineAnswered.from_body(429, b'{"error": {"message": "KV cache full"}}'), False, EngineFailure, True),
        (EngineAnswered.from_body(422, b'{"detail": "KV cache full"}'), False, InvalidRequest, None),
        (EngineAnswered.from_body(400, b'{"message": "context: KV cache full"}'), False, ContextOverflow, None),
        # an error event inside a streamed answer: the engine is alive
        (EngineAnswered.from_event({"message": "KV cache full", "code": 500}), False, EngineFailure, False),
        (EngineAnswered.from_event("KV cache full"), False, EngineFailure, False),
        (EngineAnswered.from_event({"message": "KV cache full", "code": 400}), False, InvalidRequest, None),
        # transport: a head that does not come is one stuck exchange; an answer that stops, the engine's
        (TimeoutError(), True, EngineFailure, False),
        (TimeoutError("KV cache full"), False, EngineFailure, True),
        (aiohttp.ClientPayloadError("KV cache full"), False, EngineFailure, True),
        (aiohttp.ServerDisconnectedError("KV cache full"), True, EngineFailure, True),
        (ValueError("KV cache full"), True, InvalidRequest, None),  # a request that HTTP cannot carry
    ],
)
def test_one_place_maps_what_goes_wrong_in_an_exchange(
    raised: Exception, sending: bool, expected: type[Exception], engine_down: bool | None
) -> None:
    error = mapped(raised, URL, sending=sending, head_timeout=20.0)
    assert type(error) is expected
    assert "KV cache full" in str(error) or (isinstance(raised, TimeoutError) and sending)
    if engine_down is not None:
        assert isinstance(error, EngineFailure) and error.engine_down is engine_down
    assert mapped(ValueError("a bug of ours"), URL) is None  # reading: not the exchange's to map


async def test_a_head_that_does_not_come_keeps_the_engine_in_rotation(monkeypatch: pytest.MonkeyPatch) -> None:
    """One stuck exchange fails that request; the health probe, not the failure, judges the engine."""

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(30)

    server = await asyncio.start_server(never_answers, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setattr(remote_client, "HEAD_TIMEOUT", 0.2)
    router = Router([VLLMEngine(f"http://127.0.0.1:{port}")])
    (engine,) = router.engines
    try:
        with pytest.raises(EngineFailure, match="sent no answer within 0 s") as failure:
            async for _ in router.generate(PROMPT, SamplingParams(max_tokens=5), seed=1, session_id="s"):
                pass
        assert not failure.value.engine_down and engine.healthy
    finally:
        await router.close()
        server.close()


@pytest.mark.parametrize("more", [False, True])
def test_the_tokens_of_one_event_follow_each_other(more: bool) -> None:
    sampled = [SampledToken(7, -0.5, ((7, -0.5),), "raw", 3), SampledToken(8, -1.0), SampledToken(9, -2.0)]
    marked = came_together(sampled, more)
    assert [t.follows for t in marked] == [True, True, more]
    fields = ("token_id", "logprob", "top_logprobs", "logprob_mode", "version")
    assert [[getattr(t, f) for f in fields] for t in marked] == [[getattr(t, f) for f in fields] for t in sampled]
    assert marked == sampled, "a hint for the stream alone: tokens compare as they were"
    assert [t.follows for t in came_together(sampled[:1], more)] == [more]
    assert came_together([], more) == []

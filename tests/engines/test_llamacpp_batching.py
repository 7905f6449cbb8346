"""Continuous batching in the embedded engine, on the F32 weights the trainer uses: every generation
decoded in a shared batch records the logprobs of its own sequence, as an independent single-sequence
llama.cpp context recomputes them; sessions never see each other's tokens; a session's next turn
prefills only its new tokens; a cancelled generation leaves the others running; a weight update
lands on a whole batch at a token boundary.

The bound: a batched step multiplies the weights by several rows at once, and a sequence's KV sits
among other sequences' cells in the shared cache, so its float32 sums are taken in another order
than in a context of its own (measured: at most 3e-5 nats on F32 weights with an F32 KV cache). The
tests allow 1e-3 nats, room for other CPUs' kernels, while a sequence fed another's KV or read from
another's row of logits is off by tenths of a nat or more.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from tests.support.lora import write_lora
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings, default_threads
from tokentape.engines.sampler import log_softmax
from tokentape.gateway.calls import ChatCall, ChoiceDone, Event
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.render.renderer import Renderer, RenderOptions
from tokentape.store.sqlite import SqliteStore

pytest.importorskip("gguf")
from tokentape.train.weights import f32_gguf

BOUND = 1e-3  # nats; see the module docstring
pytestmark = pytest.mark.numerics  # every test compares with an independent context's logprobs
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
QUESTIONS = ["Name three colours.", "What is 2+2?", "Write a haiku about rain.", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def f32_path(model_path: Path) -> Path:
    return f32_gguf(model_path)


@pytest.fixture(scope="module")
def batching(f32_path: Path) -> Iterator[LlamaCppEngine]:
    engine = LlamaCppEngine(LlamaCppSettings(model_path=f32_path, context_length=512, kv_cache_f32=True, parallel=4))
    yield engine
    asyncio.run(engine.close())


class Reference:
    """One sequence at a time in a context of its own (llama-cpp-python's high-level API, the whole
    sequence in one batch): the log-softmax each position's next token was drawn from."""

    def __init__(self, model: Path, lora: Path | None = None) -> None:
        self.llama = llama_cpp.Llama(
            str(model),
            n_ctx=512,
            n_batch=512,
            logits_all=True,
            type_k=0,
            type_v=0,
            lora_path=None if lora is None else str(lora),
            n_threads=default_threads(),
            verbose=False,
        )

    def rows(self, tokens: Sequence[int], start: int, temperature: float = 1.0) -> list[np.ndarray]:
        """The distributions of tokens[start:], each given all tokens before it."""
        self.llama.reset()  # type: ignore[no-untyped-call]
        self.llama.eval(list(tokens))
        scores = np.asarray(self.llama.scores[start - 1 : len(tokens) - 1], dtype=np.float64)
        return [log_softmax(row / (temperature or 1.0)) for row in scores]

    def close(self) -> None:
        self.llama.close()


@pytest.fixture(scope="module")
def reference(f32_path: Path) -> Iterator[Reference]:
    ref = Reference(f32_path)
    yield ref
    ref.close()


def _check(reference: Reference, prompt: list[int], samples: list[SampledToken], temperature: float = 0.0) -> None:
    """Each recorded logprob is the recomputed one, and each greedy token the recomputed argmax (or
    within the bound of it: a near tie)."""
    assert samples
    rows = reference.rows(prompt + [s.token_id for s in samples], len(prompt), temperature)
    for row, sample in zip(rows, samples, strict=True):
        assert abs(row[sample.token_id] - sample.logprob) <= BOUND
        if temperature == 0.0:
            assert row[sample.token_id] >= row.max() - BOUND


def _prompts(renderer: Renderer, questions: Sequence[str] = QUESTIONS) -> list[list[int]]:
    # a short system prompt (the template's default one is 30 tokens): less for both sides to compute
    system = {"role": "system", "content": "Be brief."}
    return [renderer.prompt([system, {"role": "user", "content": q}], RenderOptions()).tokens for q in questions]


async def _generate(
    engine: LlamaCppEngine, prompt: list[int], params: SamplingParams = GREEDY, **kwargs: object
) -> list[SampledToken]:
    return [s async for s in engine.generate(prompt, params, seed=kwargs.pop("seed", 0), **kwargs)]  # type: ignore[arg-type]


async def test_each_sequence_of_a_batch_records_its_own_logprobs(
    batching: LlamaCppEngine, reference: Reference, renderer: Renderer
) -> None:
    prompts = _prompts(renderer)
    steps, rows = batching._batcher.steps, batching._batcher.batched_sequences
    results = await asyncio.gather(*(_generate(batching, p) for p in prompts))
    assert (batching._batcher.batched_sequences - rows) / (batching._batcher.steps - steps) > 2  # batched
    for prompt, samples in zip(prompts, results, strict=True):
        _check(reference, prompt, samples)
    # one at a time: the same tokens, unless the two runs parted at a near tie
    for prompt, batched in zip(prompts[:2], results[:2], strict=True):
        alone = [s.token_id for s in await _generate(batching, prompt)]
        tokens = [s.token_id for s in batched]
        if alone != tokens:
            at = next(i for i, (a, b) in enumerate(zip(alone, tokens, strict=False)) if a != b)
            row = reference.rows(prompt + tokens[: at + 1], len(prompt) + at)[0]
            assert abs(row[alone[at]] - row[tokens[at]]) <= 2 * BOUND


async def test_choices_of_one_prompt_share_its_kv_and_nothing_else(
    batching: LlamaCppEngine, reference: Reference, renderer: Renderer
) -> None:
    """n > 1: four seeded choices of one prompt in one batch; the prompt is computed once and copied,
    and each choice then sees only its own tokens."""
    prompt = _prompts(renderer, ["Tell me a story about a dragon who likes tea."])[0]
    sampling = SamplingParams(temperature=1.0, max_tokens=6, logprobs=True, top_logprobs=3)
    saved = batching._batcher.prefill_tokens_saved
    choices = await asyncio.gather(*(_generate(batching, prompt, sampling, seed=seed) for seed in range(4)))
    assert batching._batcher.prefill_tokens_saved - saved >= 3 * (len(prompt) - 1)
    assert len({tuple(s.token_id for s in c) for c in choices}) > 1  # the seeds drew different tokens
    for samples in choices:
        _check(reference, prompt, samples, temperature=1.0)
        assert all(len(s.top_logprobs) == 3 for s in samples)
    again = await _generate(batching, prompt, sampling, seed=2)
    assert [s.token_id for s in again] == [s.token_id for s in choices[2]]  # a seed is per sequence


async def test_a_second_turn_prefills_only_its_new_tokens(
    batching: LlamaCppEngine, reference: Reference, renderer: Renderer
) -> None:
    first, *others = _prompts(renderer)
    turn = await _generate(batching, first, session_id="a")
    await asyncio.gather(*(_generate(batching, p, session_id=f"other-{i}") for i, p in enumerate(others)))
    bridge = renderer.tokenizer.encode("\nAnd one more?\n")
    second = first + [s.token_id for s in turn] + bridge
    prompt_tokens, saved = batching._batcher.prompt_tokens, batching._batcher.prefill_tokens_saved
    reply = await _generate(batching, second, session_id="a")
    assert batching._batcher.prompt_tokens - prompt_tokens == len(second)
    # the slot holds the first prompt and every sampled token but the last (never fed back)
    assert batching._batcher.prefill_tokens_saved - saved == len(first) + len(turn) - 1
    _check(reference, second, reply)


async def test_a_long_prompt_moves_idle_kv_to_host_memory_and_its_session_gets_it_back(
    batching: LlamaCppEngine, reference: Reference, renderer: Renderer
) -> None:
    """A prompt of 256 or more new tokens is read with no idle session's KV in the cache: the idle
    slots' KV goes to host memory, and a session's next turn puts its own back, bit for bit (it
    prefills only its new tokens, and records what an independent context computes)."""
    first = _prompts(renderer, ["Name a fruit."])[0]
    turn = await _generate(batching, first, session_id="kept")
    long = _prompts(renderer, [" ".join(f"item {i}," for i in range(70)) + " which is the largest?"])[0]
    assert len(long) >= 256
    engine = batching.describe()
    await _generate(batching, long, session_id="long")
    assert batching.describe()["kv_offloaded"] > engine["kv_offloaded"]
    second = first + [s.token_id for s in turn] + renderer.tokenizer.encode("\nAnd one more?\n")
    saved = batching._batcher.prefill_tokens_saved
    reply = await _generate(batching, second, session_id="kept")
    assert batching.describe()["kv_restored"] > engine["kv_restored"]
    assert batching._batcher.prefill_tokens_saved - saved == len(first) + len(turn) - 1
    _check(reference, second, reply)


async def test_a_cancelled_generation_leaves_the_others_running(
    batching: LlamaCppEngine, reference: Reference, renderer: Renderer
) -> None:
    prompts = _prompts(renderer)[:3]
    long = SamplingParams(temperature=0.0, max_tokens=12)

    async def cancelled() -> int:
        stream = batching.generate(prompts[0], long, seed=0)
        async with contextlib.aclosing(stream):
            async for _ in stream:
                return 1
        return 0

    sampled = batching.tokens_sampled
    results = await asyncio.gather(cancelled(), *(_generate(batching, p, long) for p in prompts[1:]))
    for prompt, samples in zip(prompts[1:], results[1:], strict=True):
        assert len(samples) == 12 or samples[-1].token_id in batching._end_of_turn  # ran to its end
        _check(reference, prompt, samples)
    deadline = asyncio.get_running_loop().time() + 30
    while batching.waiting and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert batching.waiting == 0 and not batching._batcher.active
    # the cancelled one sampled at most the token of the step it was closed in, beyond what it handed over
    assert batching.tokens_sampled - sampled - sum(len(s) for s in results[1:]) - 1 <= 2


async def test_a_constrained_sequence_shares_a_batch_with_free_ones(
    batching: LlamaCppEngine, reference: Reference, renderer: Renderer
) -> None:
    prompts = _prompts(renderer)[:3]
    constraint = Constraint("grammar", 'root ::= "The answer is " [0-9] [0-9] "."')
    constrained, *free = await asyncio.gather(
        _generate(batching, prompts[0], SamplingParams(temperature=0.0, max_tokens=16), constraint=constraint),
        *(_generate(batching, p) for p in prompts[1:]),
    )
    text = renderer.tokenizer.decode([s.token_id for s in constrained if s.token_id not in batching._end_of_turn])
    assert text[: len("The answer is ")] == "The answer is " and text[-1] == "." and text[-3:-1].isdigit()
    for prompt, samples in zip(prompts[1:], free, strict=True):
        _check(reference, prompt, samples)


class Holding:
    """The engine, holding each of its first `count` generations after `after` tokens until every
    one of them got there, so that an update lands on a whole batch mid-turn."""

    def __init__(self, inner: LlamaCppEngine, count: int, after: int) -> None:
        self.inner, self.engines = inner, [inner]
        self.count, self.after = count, after
        self.model_id, self.context_length = inner.model_id, inner.context_length
        self.reached = 0
        self.all_reached = asyncio.Event()

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, **kwargs: object
    ) -> AsyncIterator[SampledToken]:
        held = self.reached < self.count and not self.all_reached.is_set()
        stream = self.inner.generate(prompt, params, **kwargs)  # type: ignore[arg-type]
        async with contextlib.aclosing(stream):
            count = 0
            async for token in stream:
                if held and count == self.after:
                    self.reached += 1
                    if self.reached == self.count:
                        self.all_reached.set()
                    await asyncio.Event().wait()  # until the update cuts it
                count += 1
                yield token

    def describe(self) -> dict[str, object]:
        return self.inner.describe()

    async def close(self) -> None:
        return None


async def test_a_weight_update_lands_on_a_whole_batch_at_a_token_boundary(
    batching: LlamaCppEngine, reference: Reference, renderer: Renderer, f32_path: Path, tmp_path: Path
) -> None:
    """Three turns running together when a LoRA comes in (continue): each keeps its first tokens,
    sampled by the base weights, and goes on under the adapter from its prompt plus those tokens."""
    adapter = write_lora(tmp_path / "adapter.gguf", seed=0)
    k, count = 2, 6
    holding = Holding(batching, 3, k)
    gateway = Gateway(holding, renderer, SessionRegistry(SqliteStore(":memory:")))  # type: ignore[arg-type]

    async def turn(question: str, session: str) -> list[Event]:
        call = ChatCall(
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
            sampling=SamplingParams(temperature=0.0, max_tokens=count),
            session_id=session,
        )
        return [event async for event in gateway.run(call, streamed=True)]

    turns = [asyncio.create_task(turn(q, f"u{i}")) for i, q in enumerate(QUESTIONS[:3])]
    await asyncio.wait_for(holding.all_reached.wait(), 120)
    try:
        await gateway.update_weights(1, lora=str(adapter), in_flight="continue")
        done = [(await asyncio.wait_for(t, 120))[-1] for t in turns]
    finally:
        await batching.load_weights(batching.start_source, 0)  # the module's engine back on the base weights
    tuned = Reference(f32_path, adapter)
    try:
        for question, last in zip(QUESTIONS, done, strict=False):
            assert isinstance(last, ChoiceDone) and len(last.tokens) == count
            prompt = _prompts(renderer, [question])[0]
            sequence = prompt + [t.token_id for t in last.tokens]
            before, after = last.tokens[:k], last.tokens[k:]
            base = reference.rows(sequence, len(prompt))
            new = tuned.rows(sequence, len(prompt) + k)
            assert all(abs(row[t.token_id] - t.logprob) <= BOUND for row, t in zip(base[:k], before, strict=True))
            assert all(abs(row[t.token_id] - t.logprob) <= BOUND for row, t in zip(new, after, strict=True))
            # and not what the base weights would have given there
            assert max(abs(row[t.token_id] - t.logprob) for row, t in zip(base[k:], after, strict=True)) > 10 * BOUND
    finally:
        tuned.close()

"""Turns go on across a weight update. An update lands after token k of a running turn: under
`continue` the client gets one reply whose first k tokens are the old weights' and whose rest equal
a cold run of the new weights from the prompt plus those k tokens; `policy_spans` say so. `keep` the
same, marking the KV's version; `abort` ends the turn there. Under many updates and several agents at
once, every token the engine handed over is recorded exactly once."""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path

import pytest

from tests.support.served import build
from tests.support.weights import Stepper
from tests.weights.reference import cold_greedy, cold_greedy_kept
from tokentape.core.sampling import SamplingParams
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.gateway.calls import ChatCall, ChoiceDone, Event, Started, TextDelta
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.render.renderer import Renderer
from tokentape.store.sqlite import SqliteStore

K = 3
MAX_TOKENS = 10


def _call(session: str, max_tokens: int = MAX_TOKENS, content: str = "Write a poem about the sea.") -> ChatCall:
    return ChatCall(
        messages=[{"role": "user", "content": content}],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        session_id=session,
    )


async def _run(gateway: Gateway, call: ChatCall, streamed: bool) -> list[Event]:
    return [event async for event in gateway.run(call, streamed=streamed)]


@pytest.mark.parametrize("streamed", [True, False])
@pytest.mark.parametrize("mode", ["continue", "keep"])
async def test_a_turn_goes_on_across_an_update_as_one_reply(
    fresh: Gateway,
    own_engine: LlamaCppEngine,
    renderer: Renderer,
    model_path: Path,
    adapters: list[Path],
    streamed: bool,
    mode: str,
) -> None:
    stepper = Stepper(own_engine, hold_after=K)
    gateway = Gateway(stepper, renderer, SessionRegistry(SqliteStore(":memory:")))
    turn = asyncio.create_task(_run(gateway, _call("t"), streamed))
    await asyncio.wait_for(stepper.reached.wait(), 60)
    report = await gateway.update_weights(1, lora=str(adapters[0]), in_flight=mode)
    assert report["version"] == 1
    events = await asyncio.wait_for(turn, 60)

    started, done = events[0], events[-1]
    assert isinstance(started, Started) and isinstance(done, ChoiceDone)
    assert sum(isinstance(e, ChoiceDone) for e in events) == 1 and done.finish_reason == "length"
    deltas = [e for e in events if isinstance(e, TextDelta)]
    if not streamed:
        assert len(deltas) == 1  # an unstreamed client gets one answer
    streamed_tokens = [t for d in deltas for t in d.tokens]
    assert streamed_tokens == done.tokens and len(done.tokens) == MAX_TOKENS  # max_tokens across the seam
    prompt = list(started.prompt_token_ids)
    tokens = [t.token_id for t in done.tokens]
    logprobs = [t.logprob for t in done.tokens]
    old = cold_greedy(model_path, prompt, K)
    fresh_kv = cold_greedy(model_path, prompt + tokens[:K], MAX_TOKENS - K, lora=adapters[0])
    assert (tokens[:K], logprobs[:K]) == old
    if mode == "continue":  # the new weights from prompt + k tokens, fresh KV
        assert (tokens[K:], logprobs[K:]) == fresh_kv
    else:  # keep: on the KV the old weights computed for prompt + the first k - 1 tokens
        assert (tokens[K:], logprobs[K:]) == cold_greedy_kept(
            model_path, prompt, tokens[:K], adapters[0], MAX_TOKENS - K
        )
        assert logprobs[K:] != fresh_kv[1]
    assert stepper.prompts[-1] == prompt + tokens[:K]  # generated on from prompt + the k tokens

    (node,) = (await gateway.sessions.get("t")).tree.leaves
    assert list(node.sampled) == tokens
    spans = [s.as_dict() for s in node.policy_spans]
    second = {"version": 1, "start": K, "end": MAX_TOKENS}
    if mode == "keep":
        second["kv_version"] = 0
    assert spans == [{"version": 0, "start": 0, "end": K}, second]
    assert "".join(d.text for d in deltas) == done.text == renderer.tokenizer.decode(tokens)


async def test_a_turn_cut_after_its_last_token_ends_instead_of_going_on(
    fresh: Gateway, own_engine: LlamaCppEngine, renderer: Renderer, adapters: list[Path]
) -> None:
    """At max_tokens a turn only waits for the engine to say it is done; an update cutting it then
    ends it (finish reason length) and generates nothing more."""
    stepper = Stepper(own_engine, hold_after=K)
    gateway = Gateway(stepper, renderer, SessionRegistry(SqliteStore(":memory:")))
    turn = asyncio.create_task(_run(gateway, _call("last", max_tokens=K), True))
    await asyncio.wait_for(stepper.reached.wait(), 60)
    await gateway.update_weights(1, lora=str(adapters[0]))
    done = (await asyncio.wait_for(turn, 60))[-1]
    assert isinstance(done, ChoiceDone) and done.finish_reason == "length" and len(done.tokens) == K
    assert stepper.calls == 1
    (node,) = (await gateway.sessions.get("last")).tree.leaves
    assert [s.as_dict() for s in node.policy_spans] == [{"version": 0, "start": 0, "end": K}]


async def test_abort_ends_the_turn_at_the_update(
    fresh: Gateway, own_engine: LlamaCppEngine, renderer: Renderer, adapters: list[Path]
) -> None:
    stepper = Stepper(own_engine, hold_after=K)
    gateway = Gateway(stepper, renderer, SessionRegistry(SqliteStore(":memory:")))
    turn = asyncio.create_task(_run(gateway, _call("a"), True))
    await asyncio.wait_for(stepper.reached.wait(), 60)
    update = asyncio.create_task(gateway.update_weights(1, lora=str(adapters[0]), in_flight="abort"))
    while not gateway.paused:  # past its check: generation held, running turns told to end
        await asyncio.sleep(0.005)
    stepper.gate.set()  # the held token comes; the turn ends after it
    await asyncio.wait_for(update, 60)
    done = (await asyncio.wait_for(turn, 60))[-1]
    assert isinstance(done, ChoiceDone) and done.finish_reason == "abort" and len(done.tokens) == K + 1
    (node,) = (await gateway.sessions.get("a")).tree.leaves
    assert [s.as_dict() for s in node.policy_spans] == [{"version": 0, "start": 0, "end": K + 1}]
    assert stepper.calls == 1  # not run again


async def test_many_updates_under_several_agents_lose_and_double_nothing(
    fresh: Gateway, own_engine: LlamaCppEngine, adapters: list[Path]
) -> None:
    rng = random.Random(7)
    updates, agents, turns_each = 50, 8, 6
    handed_before = own_engine.tokens_generated
    seen: dict[str, list[int]] = {}

    async def agent(name: str) -> None:
        for turn in range(turns_each):
            call = _call(name, max_tokens=12, content=f"Agent {name}, step {turn}: describe a colour.")
            events = await _run(fresh, call, streamed=turn % 2 == 0)
            done = events[-1]
            assert isinstance(done, ChoiceDone)
            streamed = [t.token_id for e in events if isinstance(e, TextDelta) for t in e.tokens]
            assert streamed == [t.token_id for t in done.tokens]
            seen.setdefault(name, []).extend(streamed)

    async def trainer() -> None:
        handed = own_engine.tokens_generated
        for version in range(1, updates + 1):
            await asyncio.sleep(rng.uniform(0.05, 0.25))  # tokens flow between updates
            # and every tenth update waits for a token since the one before: on a slow machine, an update
            # every 0.05-0.25 s could land before any running turn had read its prompt again, every time
            while version % 10 == 0 and own_engine.tokens_generated == handed:
                await asyncio.sleep(0.01)
            handed = own_engine.tokens_generated
            mode = rng.choice(["continue", "continue", "keep"])
            await fresh.update_weights(version, lora=str(adapters[version % 3]), in_flight=mode)

    await asyncio.wait_for(asyncio.gather(trainer(), *(agent(f"g{i}") for i in range(agents))), 600)

    recorded = 0
    seams = 0
    for i in range(agents):
        tree = (await fresh.sessions.get(f"g{i}")).tree
        sampled = [t for node in tree.nodes for t in node.sampled]
        assert sampled == seen[f"g{i}"]  # what the client got is what was recorded, in order
        for node in tree.nodes:
            spans = node.policy_spans
            assert spans[0].start == 0 and spans[-1].end == len(node.sampled)
            assert all(a.end == b.start and a.version < b.version for a, b in itertools.pairwise(spans))
            seams += len(spans) - 1
        recorded += len(sampled)
    # every token the engine handed over is on a tape exactly once (its probe runs on a scratch context)
    assert own_engine.tokens_generated - handed_before == recorded
    assert fresh.gate.version == updates and seams > 0


async def test_the_real_sdk_gets_one_stream_across_an_update(
    fresh: Gateway, own_engine: LlamaCppEngine, renderer: Renderer, model_path: Path, adapters: list[Path]
) -> None:
    """Over HTTP with the openai SDK: one streamed completion, its tokens (from the chunks' logprobs)
    the old weights' up to k and the new ones' after, finish reason length at max_tokens."""
    import httpx
    import openai

    stepper = Stepper(own_engine, hold_after=K)
    app = build(stepper, renderer, model="smollm2").app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        sdk = openai.AsyncOpenAI(base_url="http://t/sessions/sdk/v1", api_key="x", http_client=http, max_retries=0)

        async def read() -> tuple[list[int], list[float], list[str | None], str]:
            stream = await sdk.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Write a poem about the sea."}],
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                logprobs=True,
                stream=True,
            )
            ids: list[int] = []
            logprobs: list[float] = []
            finishes: list[str | None] = []
            text = ""
            async for chunk in stream:
                for choice in chunk.choices:
                    finishes.append(choice.finish_reason)
                    text += choice.delta.content or ""
                    for item in (choice.logprobs.content or []) if choice.logprobs else []:
                        ids.append(int(item.model_extra["token_id"]))  # type: ignore[index]
                        logprobs.append(item.logprob)
            return ids, logprobs, finishes, text

        reading = asyncio.create_task(read())
        await asyncio.wait_for(stepper.reached.wait(), 60)
        update = await http.post("/admin/weights", json={"version": 1, "lora": str(adapters[1])})
        assert update.status_code == 200, update.text
        ids, logprobs, finishes, text = await asyncio.wait_for(reading, 60)
    assert [f for f in finishes if f is not None] == ["length"] and len(ids) == MAX_TOKENS
    prompt = stepper.prompts[0]
    assert (ids[:K], logprobs[:K]) == cold_greedy(model_path, prompt, K)
    assert (ids[K:], logprobs[K:]) == cold_greedy(model_path, prompt + ids[:K], MAX_TOKENS - K, lora=adapters[1])
    assert text == renderer.tokenizer.decode(ids)

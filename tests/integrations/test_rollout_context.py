"""`tokentape rollout`'s episodes end with a status: one whose next request no longer fits the context
ends there (`context_full`, rewarded as configured, its turns kept), beside a `done` one and an
`error` one; none stops the run."""

from __future__ import annotations

import anthropic
import openai

from tokentape.client import InProcessGateway
from tokentape.rollout import Episode, run_rollout
from tokentape.served import Served

FILLER = "one two three four five six seven eight nine ten " * 15  # most of small_built's 256-token context


async def agent(client: openai.AsyncOpenAI, episode: Episode) -> float:
    """Episode 0 answers once; episode 1 keeps talking until the context is full; episode 2 crashes."""
    messages: list[dict[str, str]] = [{"role": "user", "content": "Say hi."}]
    turns = 1 if episode.index != 1 else 10
    for turn in range(turns):
        if episode.index == 1:
            messages.append({"role": "user", "content": FILLER if turn == 0 else "Go on, count further."})
        reply = await client.chat.completions.create(
            model=episode.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=200,  # past the room left on its second turn: clipped to it
            temperature=0.0,
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    if episode.index == 2:
        raise RuntimeError("the environment crashed")
    return 1.0


async def test_an_episode_that_fills_the_context_ends_with_its_status(small_built: Served) -> None:
    local = InProcessGateway(served=small_built)
    try:
        stats = await run_rollout(
            agent, local, episodes=3, concurrency=1, group_size=3, run_id="ctx", overflow_reward=-0.5
        )
        assert (stats.done, stats.errors, stats.context_full) == (3, 1, 1)
        exported = {s["session_id"]: s for s in (await local.export_all(prefix="ctx-"))["data"]}
        status = {sid: s["metadata"]["status"] for sid, s in exported.items()}
        assert status == {"ctx-00000": "done", "ctx-00001": "context_full", "ctx-00002": "error"}
        full = exported["ctx-00001"]
        assert full["reward"] == -0.5
        (branch,) = (await local.export("ctx-00001"))["branches"]
        assert len(branch["tokens"]) == small_built.gateway.engine.context_length  # clipped to the room, then full
        assert branch["finish_reasons"][-1] == "length"
        assert exported["ctx-00000"]["reward"] == 1.0 and exported["ctx-00002"]["reward"] is None
    finally:
        await local.aclose()


async def test_an_anthropic_sdk_agent_that_fills_the_context_ends_the_same_way(small_built: Served) -> None:
    local = InProcessGateway(served=small_built)

    async def claude_style(client: openai.AsyncOpenAI, episode: Episode) -> float:
        base = str(client.base_url).rstrip("/").removesuffix("/v1")  # .../sessions/<id>
        sdk = anthropic.AsyncAnthropic(base_url=base, api_key=client.api_key, http_client=local.http, max_retries=0)
        messages: list[dict[str, str]] = [{"role": "user", "content": FILLER}]
        for _ in range(10):
            reply = await sdk.messages.create(model=episode.model, max_tokens=200, messages=messages)  # type: ignore[arg-type]
            text = "".join(getattr(block, "text", "") for block in reply.content)
            messages += [{"role": "assistant", "content": text or "..."}, {"role": "user", "content": "Go on."}]
        return 1.0

    try:
        stats = await run_rollout(claude_style, local, episodes=1, concurrency=1, group_size=1, run_id="claude")
        assert (stats.done, stats.errors, stats.context_full) == (1, 0, 1)
        (session,) = (await local.export_all(prefix="claude-"))["data"]
        assert session["metadata"]["status"] == "context_full" and session["reward"] == 0.0
    finally:
        await local.aclose()

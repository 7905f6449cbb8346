"""The trainer-side helpers hand each agent its own session's key: `tokentape rollout` (run_rollout
over a GatewayClient with a trainer key) and the Atropos server manager. An agent that tries to pay
itself gets 403, and the rewards recorded are the ones the trainer set."""

from __future__ import annotations

from typing import Any

import openai

from tests.auth.walk import MODEL, TRAINER
from tokentape.client import InProcessGateway
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.integrations.atropos import TokentapeServerManager
from tokentape.render.renderer import Renderer
from tokentape.rollout import Episode, run_rollout
from tokentape.served import ServeSpec


def keyed(engine: LlamaCppEngine, renderer: Renderer) -> InProcessGateway:
    spec = ServeSpec(served_model_name=MODEL, api_keys=(TRAINER,))
    return InProcessGateway(spec, engine=engine, renderer=renderer)


async def test_rollout_agents_hold_their_session_key_and_cannot_pay_themselves(
    engine: LlamaCppEngine, renderer: Renderer
) -> None:
    client = keyed(engine, renderer)
    held: dict[str, str] = {}
    refused: list[int] = []

    async def agent(llm: openai.AsyncOpenAI, episode: Episode) -> float:
        held[episode.session_id] = llm.api_key
        await llm.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        try:
            root = llm.with_options(base_url="http://tokentape.local")
            await root.post(f"/sessions/{episode.session_id}/reward", body={"reward": 100.0}, cast_to=object)
        except openai.PermissionDeniedError as exc:
            refused.append(exc.status_code)
        return 0.25

    try:
        stats = await run_rollout(agent, client, episodes=4, concurrency=2, group_size=2)
        assert stats.errors == 0 and refused == [403] * 4
        assert len(held) == 4 and len(set(held.values())) == 4
        assert all(key.startswith(f"tts.{session}.") for session, key in held.items()) and TRAINER not in held.values()
        rows: Any = await client.export_all()
        assert sorted(row["reward"] for row in rows["data"]) == [0.25] * 4  # the trainer's, not the agents'
    finally:
        await client.aclose()


async def test_atropos_managed_sessions_carry_their_own_key(engine: LlamaCppEngine, renderer: Renderer) -> None:
    client = keyed(engine, renderer)
    manager = TokentapeServerManager(client, group_id="item-1")
    try:
        async with manager.managed_server() as managed:
            await managed.chat_completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert managed._client.api_key == client.session_key(managed.session_id)
            first = managed.session_id
            managed.reset()  # the next session is created on its first call, with its own key
            await managed.chat_completion(messages=[{"role": "user", "content": "Again"}], max_tokens=2)
            assert managed.session_id != first
            assert managed._client.api_key == client.session_key(managed.session_id) != client.session_key(first)
            await managed.set_scores([1.0])
    finally:
        await client.aclose()

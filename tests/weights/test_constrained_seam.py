"""A constrained turn (a grammar or a JSON schema) cannot go on across a weight update: the engine's
grammar would start again at its root after the tokens already sampled. Such a turn runs to its end
under the version it began with; the update waits for it, then the next turn samples the new weights."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.support.weights import Stepper
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.gateway.calls import ChatCall, ChoiceDone, Event
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.render.renderer import Renderer
from tokentape.store.sqlite import SqliteStore

SCHEMA = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}


def _call(session: str) -> ChatCall:
    return ChatCall(
        messages=[{"role": "user", "content": "Name a colour, as JSON."}],
        sampling=SamplingParams(max_tokens=40, temperature=0.0),
        session_id=session,
        constraint=Constraint("json_schema", json.dumps(SCHEMA)),
    )


async def _run(gateway: Gateway, call: ChatCall) -> list[Event]:
    return [event async for event in gateway.run(call, streamed=True)]


async def test_a_constrained_turn_ends_under_its_version_and_the_update_waits_for_it(
    fresh: Gateway, own_engine: LlamaCppEngine, renderer: Renderer, adapters: list[Path]
) -> None:
    stepper = Stepper(own_engine, hold_after=3)
    gateway = Gateway(stepper, renderer, SessionRegistry(SqliteStore(":memory:")))
    turn = asyncio.create_task(_run(gateway, _call("c")))
    await asyncio.wait_for(stepper.reached.wait(), 60)
    update = asyncio.create_task(gateway.update_weights(1, lora=str(adapters[0]), in_flight="continue"))
    while gateway.gate.seam_epoch == 0:  # until the update has held new generations and marked the seam
        await asyncio.sleep(0.001)
    assert not turn.done()
    stepper.gate.set()
    events = await asyncio.wait_for(turn, 60)
    assert (await asyncio.wait_for(update, 60))["version"] == 1
    done = events[-1]
    assert isinstance(done, ChoiceDone) and done.finish_reason == "stop"
    assert set(json.loads(done.text)) == {"colour"}  # one document the grammar allowed, not two halves
    assert stepper.calls == 1  # not generated again from prompt + the sampled tokens
    (node,) = (await gateway.sessions.get("c")).tree.leaves
    assert [s.as_dict() for s in node.policy_spans] == [{"version": 0, "start": 0, "end": len(done.tokens)}]
    await _run(gateway, _call("after"))
    (later,) = (await gateway.sessions.get("after")).tree.leaves
    assert [s.version for s in later.policy_spans] == [1]

"""Pause with abort around a weight update, for a client that reads only the result: its answer is
fetched in one piece, so it has seen nothing when the pause comes; it is withdrawn (nothing
recorded), runs again after resume streamed from the engine, and a second pause cuts that run at its
next token like any streamed generation. A client that leaves meanwhile is not run again."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.gates import GatedEngine
from tokentape.core.sampling import SamplingParams
from tokentape.core.tape import TurnNode
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.errors import NotFound
from tokentape.gateway.calls import ChatCall, ChoiceDone, Event
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.render.renderer import Renderer
from tokentape.store.sqlite import SqliteStore


def _call(session: str) -> ChatCall:
    return ChatCall(
        messages=[{"role": "user", "content": "Count to ten."}],
        sampling=SamplingParams(max_tokens=8, temperature=0.0),
        session_id=session,
    )


async def _collect(gateway: Gateway, session: str) -> list[Event]:
    return [event async for event in gateway.run(_call(session), streamed=False)]


async def _turns_of(gateway: Gateway, session: str) -> list[TurnNode]:
    try:
        return (await gateway.sessions.get(session)).tree.leaves
    except NotFound:
        return []


async def _turns() -> None:
    for _ in range(50):  # a few turns of the loop, for cancellations to land
        await asyncio.sleep(0)


async def _waiting_at_the_engine(
    engine: LlamaCppEngine, renderer: Renderer, session: str
) -> tuple[GatedEngine, Gateway, asyncio.Task[list[Event]]]:
    """A gateway whose engine holds generations at its gate, and an unstreamed request waiting there."""
    gated = GatedEngine(engine)
    gateway = Gateway(gated, renderer, SessionRegistry(SqliteStore(":memory:")))
    gated.gate.clear()
    request = asyncio.create_task(_collect(gateway, session))
    await asyncio.wait_for(gated.entered.wait(), 30)
    return gated, gateway, request


async def test_a_withdrawn_answer_runs_again_streamed_and_a_second_pause_cuts_it(
    engine: LlamaCppEngine, renderer: Renderer
) -> None:
    gated, gateway, request = await _waiting_at_the_engine(engine, renderer, "w")
    assert gated.wholes == [True]  # the first run asks for its answer in one piece
    gateway.pause(abort=True)
    await _turns()
    assert not request.done() and gated.calls == 1  # withdrawn, held until resume
    gated.entered.clear()
    gateway.resume("2")
    await asyncio.wait_for(gated.entered.wait(), 30)
    assert gated.wholes == [True, False]  # the second run is streamed from the engine
    gateway.pause(abort=True)  # a second update while it waits for its first token
    gated.gate.set()
    events = await asyncio.wait_for(request, 60)
    done = events[-1]
    assert isinstance(done, ChoiceDone) and done.finish_reason == "abort" and len(done.tokens) == 1
    (turn,) = await _turns_of(gateway, "w")
    assert (turn.finish_reason, turn.policy_version, list(turn.sampled)) == ("abort", "2", [done.tokens[0].token_id])
    gateway.resume(None)
    await gateway.aclose()


@pytest.mark.parametrize("client_first", [True, False])
async def test_a_client_that_leaves_while_withdrawn_is_not_run_again(
    engine: LlamaCppEngine, renderer: Renderer, client_first: bool
) -> None:
    gated, gateway, request = await _waiting_at_the_engine(engine, renderer, "left")
    if client_first:
        request.cancel()
        gateway.pause(abort=True)
    else:
        gateway.pause(abort=True)
        request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(request, 30)
    gated.gate.set()
    gateway.resume(None)
    await _turns()
    assert gated.calls == 1
    assert await _turns_of(gateway, "left") == []
    await gateway.aclose()

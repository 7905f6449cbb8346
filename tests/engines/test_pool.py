"""The engine pool seam (`engines.base.EnginePool`) as the router offers it: what the gateway asks to
add a remote engine while it serves, or to drain one. Against stand-in vLLM servers over real HTTP."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engines.test_remote_weights import Stand
from tests.support.fake_engines import serving
from tokentape.engines.base import EnginePool
from tokentape.engines.remote import VLLMEngine
from tokentape.engines.router import Router
from tokentape.engines.scripted import ScriptedEngine
from tokentape.errors import Conflict, NotFound


class Recorder:
    """ASGI middleware: the path of every HTTP request the server was asked."""

    def __init__(self, app: Any, paths: list[str]) -> None:
        self.app, self.paths = app, paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


def test_the_router_is_a_pool_and_a_single_engine_is_not() -> None:
    assert isinstance(Router([VLLMEngine("http://127.0.0.1:9")]), EnginePool)
    assert not isinstance(ScriptedEngine([1, 2], end_of_turn=2), EnginePool)
    assert not isinstance(VLLMEngine("http://127.0.0.1:9"), EnginePool)


async def test_a_member_is_admitted_once_it_answered_and_then_routed_to() -> None:
    first, late, asked = Stand("vllm"), Stand("vllm"), list[str]()
    with serving(first.app()) as first_url, serving(Recorder(late.app(), asked)) as late_url:
        router = Router([VLLMEngine(first_url)], vocab_size=49152)
        asked_before_admission: list[list[str]] = []

        def admit() -> None:  # sees what the new engine had been asked by then
            asked_before_admission.append(list(asked))
            assert len(router.engines) == 1  # not routed to before it is admitted

        await router.add_member(f"vllm={late_url}", admit)
        assert asked_before_admission == [["/v1/models", "/health"]]
        assert [engine.base_url for engine in router.engines] == [first_url, late_url]
        await router.close()


async def test_a_member_refused_at_admission_is_not_routed_to() -> None:
    first, late = Stand("vllm"), Stand("vllm")
    with serving(first.app()) as first_url, serving(late.app()) as late_url:
        router = Router([VLLMEngine(first_url)], vocab_size=49152)

        def refuse() -> None:
            raise Conflict("the weights changed", code="weights_changed")

        with pytest.raises(Conflict):
            await router.add_member(f"vllm={late_url}", refuse)
        assert [engine.base_url for engine in router.engines] == [first_url]
        await router.close()


async def test_a_drained_member_takes_no_work_at_once_and_is_forgotten_when_idle() -> None:
    first, second = Stand("vllm"), Stand("vllm")
    with serving(first.app()) as first_url, serving(second.app()) as second_url:
        router = Router([VLLMEngine(first_url), VLLMEngine(second_url)], vocab_size=49152)
        with pytest.raises(NotFound):
            router.drain_member("http://127.0.0.1:9")  # refused before anything is awaited
        removal = router.drain_member(second_url + "/")
        drained = router.engines[1]
        assert drained.draining and router.place("new-session").base_url == first_url
        await removal
        assert [engine.base_url for engine in router.engines] == [first_url]
        await router.close()

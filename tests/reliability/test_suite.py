"""A small run of the reliability suite inside `make test`; `make reliability` runs the full one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability import suite
from tests.support.fake_engines import FakeState, serving, vllm_app
from tokentape.launcher import RunningServer, running_server


@pytest.fixture
def server(shared_server: RunningServer) -> RunningServer:
    return shared_server


async def test_malformed_requests(server: RunningServer) -> None:
    figures = await suite.malformed(server)
    assert figures["kinds"] >= 40
    assert figures["not_4xx"] == []
    assert figures["healthy"] and figures["sessions_unchanged"]


async def test_kill_loop_loses_no_acknowledged_turn(tmp_path: Path) -> None:
    """The fake vLLM engine (a stand-in remote engine, 20 ms a token) keeps six sessions writing
    while the gateway is killed: many more turns per cycle than the embedded engine allows."""
    state = FakeState(delay=0.02)
    with serving(vllm_app(state)) as url:
        figures = await suite.kill_loop(tmp_path, cycles=3, sessions=6, engine_url=url, window=(1.5, 3.0))
    assert figures["acknowledged_turns"] >= 6 * 3
    assert figures["acknowledged_turns_lost"] == 0 and figures["duplicate_turns"] == 0
    assert figures["cycles_that_extended_sessions"] == 3


async def test_disconnect_storm_aborts_every_generation(server: RunningServer) -> None:
    figures = await suite.disconnect_storm(server, clients=6)
    assert figures["generations_aborted"] == 6  # a generation that ran on after its client left fails
    assert figures["tokens_generated_not_on_the_tape"] == 0
    assert figures["max_tokens_generated_after_the_last_received"] <= 8  # stopped within a few tokens


async def test_overload_rejects_with_429_and_serves_the_rest() -> None:
    with running_server(["--context-length", "4096", "--max-active", "3"]) as small:
        figures = await suite.overload(small, offered=8, waves=2)
    assert 0 < figures["rejected_429_pct"] < 100


async def test_retry_storm_makes_no_duplicate_turns(server: RunningServer) -> None:
    figures = await suite.retry_storm(server, requests=4, retries=2)
    assert figures["duplicate_turns"] == 0 and figures["engine_calls_per_turn"] == 1.0


async def test_soak_keeps_open_files_flat(tmp_path: Path) -> None:
    figures = await suite.soak(tmp_path, sessions=500)
    assert figures["open_files_growth"] <= 2
    assert figures["sessions_in_memory_at_end"] <= 501

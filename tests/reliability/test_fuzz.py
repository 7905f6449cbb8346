"""The adversarial suite (tests/reliability/fuzz.py) against a real `tokentape serve` with the embedded
engine batching: a bounded sample inside `make test`; `make fuzz` sets TOKENTAPE_FUZZ_EXAMPLES for
5,000 batches of four requests (20,000 requests). Figures: test-output/fuzz.json."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import output_dir
from tests.reliability.fuzz import REQUEST_DEADLINE, VICTIMS, Case, Figures, Honest, cases, give_history, send
from tokentape.launcher import RunningServer, running_server

EXAMPLES = int(os.environ.get("TOKENTAPE_FUZZ_EXAMPLES", "25"))  # batches of four requests at once


@dataclass
class Live:
    server: RunningServer
    client: httpx.Client
    honest: Honest
    figures: Figures


def _engine(client: httpx.Client) -> dict[str, float]:
    metrics = client.get("/metrics").text
    found = re.findall(r"^tokentape_engine_worker_(faults|restarts) (\S+)$", metrics, re.M)
    return {f"worker_{name}": float(value) for name, value in found}


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    # a short context: no accepted request can ask for a long generation
    args = ["--context-length", "320", "--parallel", "8", "--store", ":memory:"]
    with running_server(args) as server, httpx.Client(base_url=server.base_url, timeout=REQUEST_DEADLINE) as client:
        give_history(client)
        honest = Honest(server.base_url)
        honest.start()
        live = Live(server, client, honest, Figures())
        started = time.monotonic()
        try:
            yield live
        finally:
            honest.stop()
            live.figures.seconds = time.monotonic() - started
            engine = _engine(client)
            figures = live.figures.as_json(honest, engine)
            (output_dir() / "fuzz.json").write_text(json.dumps(figures, indent=2))
        # the run as a whole: honest sessions served throughout, the engine's worker never restarted
        assert honest.turns > 0 and not honest.failures, honest.failures[:5]
        assert engine.get("worker_restarts") == 0.0, engine
        assert server.process.poll() is None


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(batch=st.tuples(*(cases(victim) for victim in VICTIMS)))
def test_no_request_hurts_the_gateway_or_another_client(live: Live, batch: tuple[Case, ...]) -> None:
    with ThreadPoolExecutor(len(batch)) as pool:
        list(pool.map(lambda case: send(live.client, case, live.figures), batch))
    figures = live.figures
    assert not figures.server_errors, figures.server_errors[:3]
    assert not figures.hung, figures.hung[:3]
    assert not figures.changed_by_refusal, figures.changed_by_refusal[:3]
    assert live.server.process.poll() is None, "the gateway exited"
    assert not live.honest.overdue() and not live.honest.failures, (live.honest.overdue(), live.honest.failures[:3])
    assert live.client.get("/health").status_code == 200

"""A `tokentape serve` (the embedded model) shared by the test files here that only send it requests:
each uses sessions of its own and measures with deltas, so none needs a fresh process (each start costs
seconds: Python's imports and the model's load). Files that kill, drain or configure their gateway
start their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokentape.launcher import RunningServer, running_server


@pytest.fixture(scope="session")
def shared_server() -> Iterator[RunningServer]:
    with running_server(["--context-length", "4096"]) as running:
        yield running

"""Odd session ids against a real `tokentape serve`: slashes, percent-encoding, `..`, control
characters and unicode, through every way a session is named. None is answered with a 5xx, every bad
one in a generation route is a 400 `invalid_session_id`, and the engine keeps serving. `make
reliability` sends 2,000 of them; this sends 300."""

from __future__ import annotations

from tests.reliability import suite
from tokentape.launcher import RunningServer


async def test_odd_session_ids_are_400s_never_5xx(shared_server: RunningServer) -> None:
    figures = await suite.odd_session_ids(shared_server, requests=300)
    assert figures["responses_5xx"] == 0, figures
    assert figures["bad_ids_not_rejected_400"] == [], figures
    assert figures["healthy"]

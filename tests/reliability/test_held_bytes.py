"""Nothing a request carries is held outside the gateway's byte budget, against a real `tokentape serve`
(the embedded engine, a store on disk): its resident set read from /proc, what it holds per kind from
/metrics (`tokentape_memory_held_bytes{kind}`, the one account its budget is checked against).

- template inputs: every turn keeps what the template was given (`chat_template_kwargs`, tools), read
  or not; twenty turns of 8 MB each grew the resident set by ~187 MB while the held bytes grew 0.01 MB,
  and such a session was never evicted nor refused;
- refused bodies: six bodies of 6 MB of empty objects, each refused 404, left +900 MB (the parse
  of each kept for the session's next body, counted by its JSON at a twentieth of what it holds);
- Responses conversations: kept for `previous_response_id` up to 100,000 of them, counted nowhere.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.reliability.probes import MODEL, held, rss_bytes
from tokentape.launcher import RunningServer, running_server

MB = 1024 * 1024


@pytest.fixture
def served(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[RunningServer, httpx.Client]]:
    budget = request.param
    args = ["--store", str(tmp_path / "store.sqlite3"), "--max-memory-bytes", str(budget)]
    with running_server(args) as server, httpx.Client(base_url=server.base_url, timeout=120) as client:
        warm = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        assert client.post("/sessions/warm/v1/chat/completions", json=warm).status_code == 200
        yield server, client


@pytest.mark.parametrize("served", [64 * MB], indirect=True)
def test_template_inputs_count_against_the_budget(served: tuple[RunningServer, httpx.Client]) -> None:
    server, client = served
    before = rss_bytes(server.process.pid)
    history = [{"role": "user", "content": "Say hi."}]
    accepted = refused = 0
    for turn in range(20):
        kwargs = {f"unused_{turn}": chr(97 + turn) * (8 * MB)}  # a value the template never reads
        body = {"model": MODEL, "messages": history, "max_tokens": 3, "chat_template_kwargs": kwargs}
        response = client.post("/sessions/wide/v1/chat/completions", json=body)
        if response.status_code == 429:  # the session alone holds the budget: it waits
            refused += 1
            continue
        assert response.status_code == 200, response.text
        accepted += 1
        reply = response.json()["choices"][0]["message"]["content"] or "."
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
        # each accepted turn kept its own 8 MB value, and the account says so
        assert held(client)["template_inputs"] >= accepted * 8 * MB
    kinds = held(client)
    assert refused > 0 and accepted < 20
    assert sum(kinds.values()) <= 64 * MB + 16 * MB  # the budget, and the one turn let in past it
    assert rss_bytes(server.process.pid) - before < 64 * MB + 48 * MB  # was +187 MB


@pytest.mark.parametrize("served", [4 * 1024 * MB], indirect=True)
def test_a_refused_body_leaves_nothing_and_a_kept_parse_counts_what_it_holds(
    served: tuple[RunningServer, httpx.Client],
) -> None:
    server, client = served
    before = rss_bytes(server.process.pid)
    empty = b"[" + b",".join([b"{}"] * (2 * MB)) + b"]"  # 6 MB of empty objects
    for i in range(6):
        body = b'{"model":"no-such-model","tools":' + empty + b',"messages":[{"role":"user","content":"hi"}]}'
        response = client.post(
            f"/sessions/nope-{i}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 404, response.text
    assert held(client)["parses"] == 0
    assert rss_bytes(server.process.pid) - before < 100 * MB  # was +930 MB

    # an accepted body's parse is kept, counted at no less than what a parse of it holds here
    # 40 KB of history, most of it in a field templates do not render (a short prompt for a CPU engine)
    history = [{"role": "user", "content": f"Note {i}.", "note": "x" * 400} for i in range(100)]
    body = orjson.dumps({"model": MODEL, "messages": history, "max_tokens": 2})
    assert client.post("/sessions/kept/v1/chat/completions", content=body).status_code == 200
    gc.collect()
    tracemalloc.start()
    parsed = orjson.loads(body)
    holds = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del parsed
    assert held(client)["parses"] >= holds > len(body)


@pytest.mark.parametrize("served", [256 * MB], indirect=True)
def test_responses_conversations_are_bounded_in_bytes_within_the_budget(
    served: tuple[RunningServer, httpx.Client],
) -> None:
    """Each response's conversation carries 2 MB of reasoning the template does not render; the
    conversations kept stay within an eighth of the budget, the oldest leaving first."""
    server, client = served
    before = rss_bytes(server.process.pid)
    ids = []
    for i in range(100):
        items = [
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": chr(97 + i % 26) * (2 * MB)}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "Say hi."},
        ]
        response = client.post(
            f"/sessions/r{i}/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 2}
        )
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
        assert held(client)["responses"] <= 256 * MB // 8
    assert held(client)["responses"] > 0
    assert rss_bytes(server.process.pid) - before < 160 * MB  # was +265 MB, and grew with every response
    more = {"model": MODEL, "input": "And?", "max_output_tokens": 2}
    latest = client.post("/v1/responses", json={**more, "previous_response_id": ids[-1]})
    assert latest.status_code == 200, latest.text
    oldest = client.post("/v1/responses", json={**more, "previous_response_id": ids[0]})
    assert oldest.status_code == 404 and oldest.json()["error"]["code"] == "previous_response_not_found"

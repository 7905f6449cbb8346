"""Clients that hold a connection without finishing with it, against a real `tokentape serve`
(`server.connections`): a head of megabytes of tiny headers is refused before the app and leaves
nothing behind once the client is gone; heads and bodies that stop arriving are answered 408 and
closed; a stream whose client stops reading is cut off, so its admission slot comes back (with
`--max-active 2`, two such clients held every other session at 429 for as long as their sockets
stayed open); two hundred Slowloris connections do not keep an honest session from its answers."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.probes import (
    MODEL,
    HonestSession,
    closed_within,
    health_seconds,
    rss_bytes,
    slow_head,
    unread_stream,
)
from tests.support.fake_engines import FakeState, serving, vllm_app
from tokentape.launcher import RunningServer, running_server

MB = 1024 * 1024


def _chat(session: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Hi from {session}."}], "max_tokens": 3, **extra}


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeState, str]]:
    state = FakeState(record=False)
    with serving(vllm_app(state)) as url:
        yield state, url


@pytest.fixture(scope="module")
def gateway(fake: tuple[FakeState, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Two admission slots; short clocks for the head, body and send, so the test waits seconds."""
    _, url = fake
    store = tmp_path_factory.mktemp("slow") / "store.sqlite3"
    args = [
        "--engine",
        f"vllm-generate={url}",
        "--served-model-name",
        MODEL,
        "--max-active",
        "2",
        "--store",
        str(store),
    ]
    args += ["--header-timeout", "2", "--body-timeout", "2", "--send-timeout", "2"]
    with running_server(args) as server:
        yield server


def test_a_head_of_tiny_headers_is_refused_before_the_app_and_leaves_nothing_behind(gateway: RunningServer) -> None:
    """10 MB of 5-byte headers: each request is answered 431 (the client reads it), and the resident
    set does not keep what the heads held: before, each such request held ~245 MB (its headers as
    two million tuples) for as long as the closed connection's keep-alive timer lived."""
    host, port = gateway.base_url.removeprefix("http://").split(":")
    head = b"GET /v1/models HTTP/1.1\r\nhost: gateway\r\n" + b"a: b\r\n" * (2 * MB) + b"\r\n"
    before = rss_bytes(gateway.process.pid)
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            with contextlib.suppress(OSError):  # refused before the client finished sending: the answer waits
                sock.sendall(head)
            answer = closed_within(sock, 10)
        assert answer is not None and answer.startswith(b"HTTP/1.1 431"), answer
        assert b'"code":"request_header_fields_too_large"' in answer
    with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
        assert client.get("/health").status_code == 200
    # 30 MB of headers went by; a head is refused past 64 KB and what it held is let go at once
    assert rss_bytes(gateway.process.pid) - before < 20 * MB


def test_too_many_headers_are_refused(gateway: RunningServer) -> None:
    headers = {f"x-h{i}": "1" for i in range(300)}
    response = httpx.get(f"{gateway.base_url}/health", headers=headers, timeout=30)
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "request_header_fields_too_large"


def test_a_head_that_stops_arriving_is_answered_408_and_closed(gateway: RunningServer) -> None:
    sock = slow_head(gateway.base_url)
    started = time.monotonic()
    with sock:
        answer = closed_within(sock, 15)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert 1.5 < time.monotonic() - started < 10  # --header-timeout 2


def test_a_body_that_stops_arriving_is_answered_408_in_the_dialects_shape(gateway: RunningServer) -> None:
    host, port = gateway.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/messages HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"model": "'
        )
        answer = closed_within(sock, 15)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"type":"error"' in answer  # Anthropic's error shape, on its route


def test_a_stream_nobody_reads_gives_its_slot_back(fake: tuple[FakeState, str], gateway: RunningServer) -> None:
    """Both slots taken by streams whose clients read nothing and keep their sockets open: other
    sessions get 429 only until --send-timeout cuts those clients off; then they are served, no
    request is left running, and each cut-off stream's turn is recorded."""
    state, _ = fake
    long_answer = [300 + i % 20000 for i in range(4000)]  # with 20 alternatives a token: 7-8 MB of stream
    state.queued[:] = [long_answer, long_answer]
    body = _chat("stuck", stream=True, max_tokens=4000, logprobs=True, top_logprobs=20)
    stuck = [unread_stream(gateway.base_url, f"stuck-{i}", body) for i in range(2)]
    try:
        with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
            time.sleep(0.5)
            refused = client.post("/sessions/other/v1/chat/completions", json=_chat("other"))
            assert refused.status_code == 429, refused.text  # both slots held by the streams
            deadline = time.monotonic() + 20
            while (
                answer := client.post("/sessions/other/v1/chat/completions", json=_chat("other"))
            ).status_code == 429:
                assert time.monotonic() < deadline, "the unread streams still hold the slots"
                time.sleep(0.5)
            assert answer.status_code == 200, answer.text
            # the first stream cut off frees the slot "other" took; the second is cut off on its own clock
            cut_off_by = time.monotonic() + 10  # --send-timeout 2, from when its socket buffers filled
            while "\ntokentape_requests_active 0.0\n" not in client.get("/metrics").text:
                assert time.monotonic() < cut_off_by, "a stream nobody reads is still running"
                time.sleep(0.2)
            for i in range(2):
                summary = client.get(f"/sessions/stuck-{i}").json()
                assert summary["turns"] == 1, summary  # recorded as any cut-off stream's turn is
    finally:
        for sock in stuck:
            sock.close()


def test_two_hundred_slowloris_connections_do_not_hold_an_honest_session(
    gateway: RunningServer, tmp_path: Path
) -> None:
    """Each connection sends part of a head and then one byte a second; the gateway answers the
    honest session throughout and closes every slow head at --header-timeout."""
    slow = [slow_head(gateway.base_url) for _ in range(200)]
    try:
        with HonestSession(gateway.base_url) as honest, httpx.Client(base_url=gateway.base_url, timeout=30) as client:
            for _ in range(4):
                for sock in slow:
                    with contextlib.suppress(OSError):
                        sock.send(b"a")
                time.sleep(1)
            lag = health_seconds(client)
        assert honest.seconds and not honest.failures, honest.failures[:3]
        assert honest.slowest < 5, honest.seconds
        assert lag < 2
        closed = sum(closed_within(sock, 0.1) is not None for sock in slow)
        assert closed == len(slow)  # every slow head was answered and closed by now (2 s of a 4 s wait)
    finally:
        for sock in slow:
            sock.close()

"""`tokentape serve` keeps an idle client connection open longer than clients keep theirs (httpx, under
the openai SDK, reuses a connection idle up to 5 s): otherwise the server closes a connection just as
the client sends its next request on it, and that request fails."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from tests.support.fake_engines import FakeState, serving, vllm_app
from tokentape.launcher import running_server

REQUEST = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"


def _answer(connection: socket.socket) -> bytes:
    connection.sendall(REQUEST)
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = connection.recv(65536)
        if not chunk:
            return answer  # the server closed the connection
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += connection.recv(65536)
    return head


def test_an_idle_connection_outlives_the_clients_keep_alive() -> None:
    # a stand-in remote engine: the keep-alive is the server's, and this starts without loading a model
    with serving(vllm_app(FakeState())) as engine, running_server(["--engine", f"vllm={engine}"]) as server:
        url = urlsplit(server.base_url)
        with socket.create_connection((url.hostname, url.port), timeout=30) as connection:
            assert _answer(connection).startswith(b"HTTP/1.1 200")
            # past uvicorn's default of 5 s and httpx's own expiry (5 s): the server armed its keep-alive
            # timer before this side read the answer, so its idle time is longer than this sleep
            time.sleep(5.5)
            assert _answer(connection).startswith(b"HTTP/1.1 200"), "the same connection still answers"

"""The key a request is known by for SDK retries: cryptographic where it finds a session (an unnamed
call's retry), a fast keyed hash where it is only looked up within its own session, and the same in
every process, since turns are stored with it and a retry may come after a restart."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import xxhash
from starlette.requests import Request

from tokentape.server.serving import Serving, request_key

BODY = b'{"model":"m","messages":[{"role":"user","content":"Hi"}]}'


def test_an_unnamed_calls_key_is_sha256_of_its_route_and_body() -> None:
    expected = hashlib.sha256(b"/v1/chat/completions\0" + BODY).digest()[:16]
    assert request_key("/v1/chat/completions", BODY, named=False) == expected


def test_a_named_calls_key_tells_routes_and_bodies_apart() -> None:
    key = request_key("/sessions/a/v1/chat/completions", BODY, named=True)
    assert len(key) == 16
    assert key == request_key("/sessions/a/v1/chat/completions", BODY, named=True)
    assert key != request_key("/sessions/b/v1/chat/completions", BODY, named=True)
    assert key != request_key("/sessions/a/v1/chat/completions", BODY + b" ", named=True)
    assert key != request_key("/sessions/a/v1/chat/completions", BODY, named=False)
    assert key != xxhash.xxh3_128_digest(b"/sessions/a/v1/chat/completions\0" + BODY)  # seeded


def test_keys_are_the_same_in_another_process() -> None:
    """Python's own hash is seeded per process; a key built on it would miss a retry after a restart."""
    script = (
        "from tokentape.server.serving import Serving, request_key; import sys;"
        f"sys.stdout.write(request_key('/sessions/a/v1/chat/completions', {BODY!r}, named=True).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert child.stdout == request_key("/sessions/a/v1/chat/completions", BODY, named=True).hex()


def _request(path: str, headers: list[tuple[bytes, bytes]], session_in_path: str | None = None) -> Request:
    params = {"session_id": session_in_path} if session_in_path else {}
    return Request({"type": "http", "method": "POST", "path": path, "headers": headers, "path_params": params})


def test_the_gateway_keys_unnamed_calls_cryptographically_and_named_ones_by_their_own_hash() -> None:
    serving = object.__new__(Serving)  # naming a caller reads no gateway unless it is a retry
    unnamed = serving.caller(_request("/v1/chat/completions", []), {}, BODY)
    assert unnamed.session_id is None
    assert unnamed.request_key == hashlib.sha256(b"/v1/chat/completions\0" + BODY).digest()[:16]
    named = [
        (_request("/v1/chat/completions", [(b"x-session-id", b"s1")]), {}),
        (_request("/v1/chat/completions", []), {"session_id": "s1"}),
        (_request("/sessions/s1/v1/chat/completions", [], "s1"), {}),
    ]
    for request, in_body in named:
        caller = serving.caller(request, in_body, BODY)
        assert caller.session_id == "s1"
        assert caller.request_key == request_key(request.scope["path"], BODY, named=True)

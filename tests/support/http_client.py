"""An httpx client for tests that call a server now and then from synchronous code."""

from __future__ import annotations

import httpx

__all__ = ["fresh_connections"]


def fresh_connections() -> httpx.Client:
    """A client that opens a connection for each request and closes it after, as `httpx.post()` does, so
    a server killed and started again is never met on a stale connection; unlike `httpx.post()`, it
    builds its TLS context once (each call of the module's functions loads the CA bundle again: about
    55 ms of CPU here, and the cluster tests make hundreds of calls). The same default timeout, 5 s."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))

"""Ray tests run on a single-machine Ray bound to loopback. Ray looks up its node address by
"connecting" toward a public address, so `make test` runs this folder inside a network namespace
that has only `lo` (see the Makefile); elsewhere these tests are skipped."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional dependency: pip install 'tokentape[ray]'")


def loopback_only() -> bool:
    return {name for _, name in socket.if_nameindex()} == {"lo"}


def free_port_block(size: int) -> int:
    """The first of `size` consecutive free ports on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + size >= 65535:
            continue
        sockets = []
        try:
            for port in range(first, first + size):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                sockets.append(s)
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no block of free ports")


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    from tokentape.ray import connect

    if not loopback_only() and os.environ.get("TOKENTAPE_RAY_TESTS") != "any-network":
        pytest.skip("Ray tests run in a loopback-only network namespace (make test does that)")

    connect("local", num_cpus=2)
    yield
    ray.shutdown()

"""Start `tokentape serve` in a child process and wait until it answers: used by the demo, the
end-to-end tests and the benchmarks, so all of them exercise the real command."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["RunningServer", "free_port", "running_server"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]
    log_path: Path

    def session_url(self, session_id: str) -> str:
        return f"{self.base_url}/sessions/{session_id}/v1"


@contextlib.contextmanager
def running_server(
    extra_args: Sequence[str] = (), *, port: int = 0, log_path: Path | None = None, timeout: float = 120.0
) -> Iterator[RunningServer]:
    """A `tokentape serve` child process on 127.0.0.1, stopped (SIGINT, then SIGKILL) on exit."""
    port = port or free_port()
    log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"tokentape-serve-{port}.log"
    log = log_path.open("wb")
    fresh_store = Path(tempfile.mkdtemp(prefix="tokentape-store-")) / "store.sqlite3"
    store = [] if "--store" in extra_args else ["--store", str(fresh_store)]
    command = [
        sys.executable,
        "-m",
        "tokentape",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *store,
        *extra_args,
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_healthy(server, timeout)
        yield server
    finally:
        _stop(process)
        log.close()


def _wait_healthy(server: RunningServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    # one client for every poll: each new one loads the CA bundle (40-100 ms of CPU here), which made
    # the poll, not the server, the busiest process while it started
    with httpx.Client(base_url=server.base_url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                log = server.log_path.read_text()
                raise RuntimeError(f"tokentape serve exited early; see {server.log_path}:\n{log}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/health").status_code == 200:
                    return
            time.sleep(0.1)
    raise TimeoutError(f"tokentape serve did not answer within {timeout:.0f} s; see {server.log_path}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

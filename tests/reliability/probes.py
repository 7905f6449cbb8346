"""What the slow-client and held-bytes tests and `make fuzz` read of a live gateway: its resident set
(from /proc, as the kernel counts it), what it holds by kind (`tokentape_memory_held_bytes{kind}` on
/metrics), how long its event loop takes to answer /health (loop lag as a client sees it), an honest
session timed turn by turn, and clients that misbehave at the socket: headers that never end, a
stream nobody reads."""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson

MODEL = "smollm2-135m-instruct"  # the embedded model's served name (and the fake engines')


def rss_bytes(pid: int) -> int:
    """The process's resident set now (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def held(client: httpx.Client) -> dict[str, float]:
    """`tokentape_memory_held_bytes` per kind, as /metrics shows it."""
    text = client.get("/metrics").text
    return {
        kind: float(value)
        for kind, value in re.findall(r'^tokentape_memory_held_bytes\{kind="(\w+)"\} (\S+)$', text, re.M)
    }


def health_seconds(client: httpx.Client, samples: int = 3) -> float:
    """The slowest of a few /health round trips: how long the loop makes any request wait."""
    worst = 0.0
    for _ in range(samples):
        started = time.monotonic()
        client.get("/health").raise_for_status()
        worst = max(worst, time.monotonic() - started)
    return worst


@dataclass
class HonestSession:
    """One client that keeps opening short sessions (a turn each) in its own thread, every turn timed."""

    base_url: str
    model: str = MODEL
    pause: float = 0.2
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> HonestSession:
        self._thread = threading.Thread(target=self._run, name="honest-session", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                started = time.monotonic()
                try:
                    response = client.post(
                        f"/sessions/honest-{n}/v1/chat/completions",
                        json={
                            "model": self.model,
                            "messages": [{"role": "user", "content": "Say hi."}],
                            "max_tokens": 3,
                        },
                    )
                    if response.status_code != 200:
                        self.failures.append(f"{response.status_code} {response.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.seconds.append(time.monotonic() - started)
                self._stop.wait(self.pause)

    @property
    def slowest(self) -> float:
        return max(self.seconds, default=0.0)

    @property
    def median(self) -> float:
        ordered = sorted(self.seconds)
        return ordered[len(ordered) // 2] if ordered else 0.0


def _address(base_url: str) -> tuple[str, int]:
    url = urlsplit(base_url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def unread_stream(base_url: str, session: str, body: dict[str, object]) -> socket.socket:
    """A streamed request whose client then reads nothing and keeps its connection open (its receive
    window as small as the kernel allows, so the gateway's writes stall soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(_address(base_url))
    payload = orjson.dumps(body)
    head = (
        f"POST /sessions/{session}/v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def slow_head(base_url: str) -> socket.socket:
    """A connection that starts a request's head and sends no more of it (Slowloris' first step)."""
    sock = socket.create_connection(_address(base_url))
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: gateway\r\nx-a: ")
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the connection, if it closed it within `seconds` (else None)."""
    sock.settimeout(0.5)
    received = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return None

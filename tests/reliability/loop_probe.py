"""Huge requests against a served gateway, and what they do to everyone else while they are handled.

Each request is inside every limit on its size (the body limit, the image count and pixel limits) and
is refused or answered as its content asks; what is measured is what it costs the others meanwhile:

- `/health`, asked every 100 ms from before the huge request is sent until after it is answered
  (each ask's time to its answer);
- an honest chat on another session, sent once the huge request is on its way;
- the gateway's own event-loop ticker (`tokentape_event_loop_lag_seconds` on `/metrics`, its
  observations during the window, by bucket).

`tests/reliability/test_loop_lag.py` runs each shape once; `make fuzz` runs each six at once, for
several rounds (`tests/reliability/loop_fuzz.py`; figures in test-output/loop-lag.json).
"""

from __future__ import annotations

import base64
import io
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = [
    "HEALTH_BOUND",
    "HONEST_BOUND",
    "Window",
    "honest_chat",
    "large_pngs",
    "lag_buckets",
    "many_tools",
    "huge_message",
    "measure",
]

HEALTH_BOUND = 1.0  # seconds /health may take while a huge request is handled
HONEST_BOUND = 5.0  # seconds an honest short chat on another session may take meanwhile
HUGE_DEADLINE = 300.0  # an unanswered huge request is a failure of its own, not a hang of the test


# -- the huge requests --------------------------------------------------------------------------------------
def many_tools(model: str, count: int = 10_000) -> dict[str, Any]:
    """`count` tools of about 1.4 KB each (13.7 MB for 10,000) and a one-word message."""
    blurb = "Looks things up in the index and answers with what it finds there, in order. " * 12
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"lookup_{i}",
                "description": blurb,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": "What to look for"},
                        "limit": {"type": "integer", "description": "How many answers at most"},
                        "filters": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["query"],
                },
            },
        }
        for i in range(count)
    ]
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "tools": tools, "max_tokens": 4}


def huge_message(model: str, size: int = 6 * 1024 * 1024) -> dict[str, Any]:
    """One user message of `size` bytes of ordinary words."""
    words = "the quick brown fox jumps over the lazy dog and runs into the forest again "
    text = (words * (size // len(words) + 1))[:size]
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def large_pngs(count: int = 64, side: int = 4096) -> list[bytes]:
    """`count` distinct PNGs of `side` x `side` pixels, about 50 KB each: one image's pixels (a plain
    colour compresses to almost nothing), each with its own text chunk, so each has its own digest
    and is decoded in full."""
    out = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (side, side), (30, 90, 160)).save(out, "PNG", compress_level=9)
    base = out.getvalue()
    end = base.rindex(b"IEND") - 4  # the IEND chunk's length field
    return [base[:end] + _chunk(b"tEXt", b"Comment\0" + str(i).encode()) + base[end:] for i in range(count)]


def image_chat(model: str, pngs: list[bytes]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What do these show?"}]
    for png in pngs:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 4}


# -- what is measured ---------------------------------------------------------------------------------------
_BUCKET = re.compile(r'^tokentape_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', re.M)
_MAX = re.compile(r"^tokentape_event_loop_lag_max_seconds (\S+)$", re.M)


def lag_buckets(client: httpx.Client) -> dict[float, float]:
    """The gateway's loop-lag histogram: cumulative count by upper bound (seconds)."""
    text = client.get("/metrics").text
    return {float(bound): float(count) for bound, count in _BUCKET.findall(text)}


def _lag_max(client: httpx.Client) -> float:
    found = _MAX.search(client.get("/metrics").text)
    return float(found.group(1)) if found else float("nan")


@dataclass
class Window:
    """What one probe saw: the huge requests' answers and times, /health's and the honest chat's
    times, and the ticker's observations during the window."""

    shape: str
    statuses: list[int] = field(default_factory=list)
    codes: list[str | None] = field(default_factory=list)
    huge_seconds: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    health_failures: list[str] = field(default_factory=list)
    honest_seconds: float = float("nan")
    honest_status: int = 0
    lag_over: dict[float, float] = field(default_factory=dict)  # bound -> observations above it
    lag_max_ever: float = float("nan")

    @property
    def slowest_health(self) -> float:
        return max(self.health, default=float("nan"))

    def problems(self, health_bound: float = HEALTH_BOUND) -> list[str]:
        """What went wrong for the others while the huge requests were handled (empty: nothing):
        /health slower than `health_bound` (or the loop held that long: a bucket bound of the ticker's
        histogram), the honest chat slower than HONEST_BOUND."""
        found = [f"/health failed: {failure}" for failure in self.health_failures[:3]]
        if not self.slowest_health < health_bound:
            found.append(f"/health took {self.slowest_health:.2f} s (at most {health_bound} s)")
        if self.honest_status != 200 or not self.honest_seconds < HONEST_BOUND:
            honest = f"{self.honest_status} after {self.honest_seconds:.2f} s"
            found.append(f"the honest chat: {honest} (at most {HONEST_BOUND} s)")
        if self.lag_over.get(health_bound, 0.0):
            found.append(f"the loop was held over {health_bound} s {self.lag_over[health_bound]:.0f} time(s)")
        return found

    def as_json(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "statuses": self.statuses,
            "codes": self.codes,
            "huge_seconds": [round(s, 2) for s in self.huge_seconds],
            "health_asks": len(self.health),
            "slowest_health_seconds": round(self.slowest_health, 3),
            "health_failures": self.health_failures[:3],
            "honest_seconds": round(self.honest_seconds, 3),
            "honest_status": self.honest_status,
            "loop_lag_observations_over": {str(k): v for k, v in self.lag_over.items()},
            "loop_lag_max_since_start_seconds": round(self.lag_max_ever, 3),
        }


def honest_chat(client: httpx.Client, session: str, model: str) -> tuple[int, float]:
    started = time.monotonic()
    response = client.post(
        f"/sessions/{session}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
        timeout=HUGE_DEADLINE,
    )
    return response.status_code, time.monotonic() - started


def measure(
    base_url: str,
    shape: str,
    body: dict[str, Any] | bytes,
    *,
    at_once: int = 1,
    honest: Callable[[httpx.Client], tuple[int, float]],
    path: str = "/v1/chat/completions",
) -> Window:
    """Send `at_once` copies of the huge `body` (JSON, or its bytes) together; meanwhile ask /health
    every 100 ms and make one honest call (`honest`); then read the ticker's observations."""
    window = Window(shape)
    slug = re.sub(r"[^a-z0-9]+", "-", shape.lower()).strip("-")
    raw = body if isinstance(body, bytes) else _dumps(body)
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=base_url, timeout=HUGE_DEADLINE) as client:
        before = lag_buckets(client)
        done = threading.Event()

        def ask_health() -> None:
            with httpx.Client(base_url=base_url, timeout=HUGE_DEADLINE) as prober:
                while not done.is_set():
                    started = time.monotonic()
                    try:
                        status = prober.get("/health").status_code
                    except httpx.HTTPError as exc:
                        window.health_failures.append(f"{type(exc).__name__}: {exc}")
                    else:
                        if status != 200:
                            window.health_failures.append(f"status {status}")
                    window.health.append(time.monotonic() - started)
                    time.sleep(0.1)

        def send(index: int) -> None:
            started = time.monotonic()
            with httpx.Client(base_url=base_url, timeout=HUGE_DEADLINE) as sender:
                response = sender.post(path, content=raw, headers={**headers, "x-session-id": f"{slug}-huge-{index}"})
            window.huge_seconds.append(time.monotonic() - started)
            window.statuses.append(response.status_code)
            try:
                window.codes.append((response.json().get("error") or {}).get("code"))
            except ValueError:
                window.codes.append(None)

        prober = threading.Thread(target=ask_health, daemon=True)
        prober.start()
        time.sleep(0.3)
        with ThreadPoolExecutor(at_once + 1) as pool:
            huge = [pool.submit(send, i) for i in range(at_once)]
            time.sleep(0.5)  # the huge bodies are read by now, and being handled
            window.honest_status, window.honest_seconds = honest(client)
            for future in huge:
                future.result()
        time.sleep(0.3)
        done.set()
        prober.join(HUGE_DEADLINE)
        time.sleep(0.1)  # the ticker's last wake-up
        after = lag_buckets(client)
        window.lag_max_ever = _lag_max(client)
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    window.lag_over = {bound: total - (after[bound] - before.get(bound, 0.0)) for bound in sorted(after)}
    return window


def _dumps(body: dict[str, Any]) -> bytes:
    import orjson

    return orjson.dumps(body)

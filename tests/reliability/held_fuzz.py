"""`make fuzz`'s standing probe of what misbehaving clients leave held: against one live gateway (a
64 MiB budget, four admission slots, 2 s clocks for heads, bodies and sends), each attack of
tests/reliability/test_held_bytes.py and test_slow_clients.py in turn, for TOKENTAPE_FUZZ_HELD_ROUNDS
rounds (default 1), while an honest session talks throughout. Per attack: the gateway's resident set
before and after (/proc), what it holds by kind (/metrics), the slowest /health answer while it ran
(loop lag as a client sees it; the gateway's own `tokentape_event_loop_lag_max_seconds` where it
reports one) and the honest session's slowest turn. Figures in test-output/held-bytes.json; the exit
status is 1 if an attack left the resident set past its bound, the account past the budget, a slot
held, or the honest session slower than five seconds or failing.

    python -m tests.reliability.held_fuzz
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.conftest import output_dir
from tests.reliability.probes import (
    MODEL,
    HonestSession,
    closed_within,
    health_seconds,
    held,
    rss_bytes,
    slow_head,
    unread_stream,
)
from tests.support.fake_engines import FakeState, serving, vllm_app
from tokentape.launcher import RunningServer, running_server

MB = 1024 * 1024
BUDGET = 64 * MB


def _template_inputs(server: RunningServer, client: httpx.Client, _: FakeState) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
    for turn in range(12):
        kwargs = {f"unused_{turn}": chr(97 + turn) * (8 * MB)}
        body = {"model": MODEL, "messages": history, "max_tokens": 3, "chat_template_kwargs": kwargs}
        response = client.post(f"/sessions/wide-{id(history)}/v1/chat/completions", json=body)
        if response.status_code == 200:
            history += [{"role": "assistant", "content": response.json()["choices"][0]["message"]["content"] or "."}]
            history += [{"role": "user", "content": "More."}]


def _headers(server: RunningServer, client: httpx.Client, _: FakeState) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    head = b"GET /v1/models HTTP/1.1\r\nhost: gateway\r\n" + b"a: b\r\n" * (2 * MB) + b"\r\n"
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            with contextlib.suppress(OSError):
                sock.sendall(head)
            closed_within(sock, 10)


def _refused_bodies(server: RunningServer, client: httpx.Client, _: FakeState) -> None:
    empty = b"[" + b",".join([b"{}"] * (2 * MB)) + b"]"
    for i in range(6):
        body = b'{"model":"no-such-model","tools":' + empty + b',"messages":[{"role":"user","content":"hi"}]}'
        client.post(f"/sessions/nope-{i}/v1/chat/completions", content=body)


def _responses(server: RunningServer, client: httpx.Client, _: FakeState) -> None:
    for i in range(60):
        items = [
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": chr(97 + i % 26) * (2 * MB)}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "Say hi."},
        ]
        client.post(f"/sessions/r{i}/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 2})


def _unread_streams(server: RunningServer, client: httpx.Client, fake: FakeState) -> None:
    long_answer = [300 + i % 20000 for i in range(4000)]
    fake.queued[:] = [long_answer, long_answer]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go."}], "stream": True}
    body |= {"max_tokens": 4000, "logprobs": True, "top_logprobs": 20}
    stuck = [unread_stream(server.base_url, f"stuck-{time.monotonic_ns()}-{i}", body) for i in range(2)]
    time.sleep(6)  # past --send-timeout: the gateway has cut them off by now
    for sock in stuck:
        sock.close()


def _slowloris(server: RunningServer, client: httpx.Client, _: FakeState) -> None:
    slow = [slow_head(server.base_url) for _ in range(200)]
    for _ in range(4):
        for sock in slow:
            with contextlib.suppress(OSError):
                sock.send(b"a")
        time.sleep(1)
    for sock in slow:
        sock.close()


# each attack and the most its resident set may grow by (the budget, and what one request in flight holds)
ATTACKS: dict[str, tuple[Callable[[RunningServer, httpx.Client, FakeState], None], int]] = {
    "template_inputs": (_template_inputs, BUDGET + 48 * MB),
    "huge_headers": (_headers, 24 * MB),
    "refused_bodies": (_refused_bodies, 100 * MB),
    "responses": (_responses, BUDGET + 96 * MB),
    "unread_streams": (_unread_streams, 48 * MB),
    "slowloris": (_slowloris, 48 * MB),
}


def _loop_lag_max(client: httpx.Client) -> float | None:
    found = re.search(r"^tokentape_event_loop_lag_max_seconds (\S+)$", client.get("/metrics").text, re.M)
    return float(found.group(1)) if found else None


def _window(name: str, server: RunningServer, client: httpx.Client, fake: FakeState) -> dict[str, Any]:
    attack, bound = ATTACKS[name]
    honest = HonestSession(server.base_url)
    pid = server.process.pid
    before = rss_bytes(pid)
    lags: list[float] = []
    done = threading.Event()

    def ask_health() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as own:
            while not done.is_set():
                lags.append(health_seconds(own, 1))
                done.wait(0.1)

    asker = threading.Thread(target=ask_health, daemon=True)
    started = time.monotonic()
    with honest:
        asker.start()
        attack(server, client, fake)
        time.sleep(1)
        done.set()
        asker.join(30)
    kinds = held(client)
    active = re.search(r"^tokentape_requests_active (\S+)$", client.get("/metrics").text, re.M)
    grown = rss_bytes(pid) - before
    figures = {
        "attack": name,
        "seconds": round(time.monotonic() - started, 1),
        "rss_growth_mb": round(grown / MB, 1),
        "rss_bound_mb": bound // MB,
        "held_mb": {kind: round(value / MB, 2) for kind, value in kinds.items()},
        "health_slowest_s": round(max(lags, default=0.0), 3),
        "loop_lag_max_s": _loop_lag_max(client),
        "honest_turns": len(honest.seconds),
        "honest_median_s": round(honest.median, 3),
        "honest_slowest_s": round(honest.slowest, 3),
        "honest_failures": honest.failures[:3],
        "requests_active_after": float(active.group(1)) if active else None,
    }
    figures["ok"] = (
        grown < bound
        and sum(kinds.values()) <= BUDGET + 16 * MB
        and figures["requests_active_after"] == 0.0
        and not honest.failures
        and honest.slowest < 5.0
    )
    return figures


def main() -> int:
    rounds = int(os.environ.get("TOKENTAPE_FUZZ_HELD_ROUNDS", "1"))
    fake = FakeState(record=False)
    store = Path(tempfile.mkdtemp(prefix="tokentape-held-")) / "store.sqlite3"
    with serving(vllm_app(fake)) as url:
        args = ["--engine", f"vllm-generate={url}", "--served-model-name", MODEL, "--store", str(store)]
        args += ["--max-memory-bytes", str(BUDGET), "--max-active", "4"]
        args += ["--header-timeout", "2", "--body-timeout", "2", "--send-timeout", "2"]
        with running_server(args) as server, httpx.Client(base_url=server.base_url, timeout=120) as client:
            windows = [_window(name, server, client, fake) for _ in range(rounds) for name in ATTACKS]
    (output_dir() / "held-bytes.json").write_text(json.dumps(windows, indent=2))
    for window in windows:
        print(orjson.dumps(window).decode())
    return 0 if all(window["ok"] for window in windows) else 1


if __name__ == "__main__":
    sys.exit(main())

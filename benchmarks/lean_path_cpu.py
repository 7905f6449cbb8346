"""The generation routes' CPU per request on the lean path, one checkout beside another.

Each request goes through the whole ASGI app in-process (guard, dialect, gateway, tape, response
bytes), on an instant scripted engine and the embedded model's renderer, so the figure is the
server's own work, with the garbage collector settled as in `tokentape serve`. Every request is a
new one-turn session, so histories do not grow. Checkouts take
turns round by round (each round a fresh process per checkout), so the shared machine's ups and
downs fall on both alike; the medians over rounds are reported.

    python benchmarks/lean_path_cpu.py --src /path/to/old/src /path/to/new/src [--rounds 7] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import orjson

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}),
    "chat+logprobs": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
    ),
    "chat stream": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "stream": True},
    ),
    "responses": ("/v1/responses", {"input": "Hi there", "max_output_tokens": 4}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}),
    "generate": ("/inference/v1/generate", {"token_ids": [1, 9690, 198], "sampling_params": {"max_tokens": 4}}),
}


async def _post(app: Any, path: str, body: bytes) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # no disconnect while the answer is written
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif status != 200 and message.get("body"):
            print(message["body"][:300], file=sys.stderr)

    await app(scope, receive, send)
    return status


async def _worker(requests: int) -> dict[str, float]:
    from tokentape.engines.scripted import ScriptedEngine
    from tokentape.runtime import embedded_model_path, gguf_renderer
    from tokentape.served import ServeSpec, build_served
    from tokentape.server.heap import settle_for_serving

    renderer = gguf_renderer(embedded_model_path())
    end = renderer.tokenizer.encode(renderer.turn_close)[0]
    engine = ScriptedEngine([42, 43, 44], end)
    built = build_served(ServeSpec(served_model_name="m"), engine=engine, renderer=renderer)
    gateway, app = built.gateway, built.app
    await gateway.start()
    settle_for_serving()  # the collector as `tokentape serve` sets it, so a collection falls on no route by chance
    spent = dict.fromkeys(BODIES, 0.0)
    counted = dict.fromkeys(BODIES, 0)
    batch = 20  # routes take turns batch by batch, so a busy moment falls on all of them alike
    try:
        for start in range(0, requests, batch):
            for name, (path, body) in BODIES.items():
                slug = name.replace(" ", "-").replace("+", "-")
                bodies = [
                    orjson.dumps({"model": "m", "session_id": f"{slug}-{start + i}", **body}) for i in range(batch)
                ]
                began = time.process_time()
                statuses = [await _post(app, path, one) for one in bodies]
                if start:  # the first batch of each route warms it up
                    spent[name] += time.process_time() - began
                    counted[name] += batch
                assert statuses == [200] * batch, statuses
    finally:
        await gateway.aclose()
    return {name: spent[name] / counted[name] * 1e3 for name in BODIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", nargs="+", help="source directories to compare (each a src/ with tokentape)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(_worker(args.requests))))
        return
    figures: dict[str, dict[str, list[float]]] = {src: {name: [] for name in BODIES} for src in args.src}
    for _ in range(args.rounds):
        for src in args.src:  # checkouts take turns
            env = {**os.environ, "PYTHONPATH": src}
            cmd = [sys.executable, __file__, "--worker", "--requests", str(args.requests)]
            result = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            for name, ms in result.items():
                figures[src][name].append(ms)
    print(f"{'route':>15} " + " ".join(f"{src[-40:]:>42}" for src in args.src))
    for name in BODIES:
        cells = [statistics.median(figures[src][name]) for src in args.src]
        print(f"{name:>15} " + " ".join(f"{ms:>39.3f} ms" for ms in cells))


if __name__ == "__main__":
    main()

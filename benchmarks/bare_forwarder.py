"""The least a Python gateway can do per call, as a floor to read gateway CPU against.

A raw ASGI app on uvicorn with uvloop and httptools (and tokentape's combined writes): it reads the
request, parses its JSON once with orjson and writes it again (a gateway that records anything reads
the body), posts it to the engine's chat route over tokentape's keep-alive HTTP/1.1 pool, and relays
the answer: a whole one parsed and written again, a stream passed through as it comes. No sessions,
no template, no tokenizer, no store. A benchmark instrument, not a gateway.

    python benchmarks/bare_forwarder.py --port 8300 --engine http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

import orjson
import uvicorn
from scripted_vllm import Receive, Scope, Send, json_body  # the same ASGI plumbing (this directory is on the path)

from tokentape.engines.http1 import Http1Pool
from tokentape.server.write_combining import WriteCombiningHttpTools

JSON = [(b"content-type", b"application/json")]


def forwarder(engine: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    pool: Http1Pool | None = None  # made on the serving loop

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal pool
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": JSON})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        body = orjson.dumps(await json_body(receive))
        if pool is None:
            pool = Http1Pool(engine, limit=4096, keepalive=600, connect_timeout=10, pool_timeout=600, read_timeout=600)
        answer = await pool.post("/v1/chat/completions", body, {"Content-Type": "application/json"})
        if answer.content_type == "application/json":
            data = orjson.dumps(orjson.loads(await answer.read()))
            answer.release()
            await send({"type": "http.response.start", "status": answer.status, "headers": JSON})
            await send({"type": "http.response.body", "body": data})
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        async for chunk in answer.chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        answer.release()
        await send({"type": "http.response.body", "body": b""})

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", required=True, help="the engine's base URL (its chat route is called)")
    args = parser.parse_args()
    uvicorn.run(
        forwarder(args.engine),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http=WriteCombiningHttpTools,
        log_level="warning",
        lifespan="on",
        timeout_keep_alive=600,
    )

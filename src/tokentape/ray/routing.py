"""Requests reach the gateway that owns their session, wherever they arrive.

Every gateway of a cluster (and the front process, which owns no session) wraps its app in
`OwnerRouting`. A request names its session as every gateway reads it (`server.session_names`:
base URL path, `X-Session-ID` header, `session_id` body field, a harness's own id). If this process
owns the session, its own app answers; otherwise the request goes to the owner through
`Peers.forward` (a Ray actor call, streamed), so an agent may talk to any gateway. `GET /sessions`
and `GET /export` gather every gateway's shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Protocol
from urllib.parse import parse_qs, urlencode

import orjson

from tokentape.errors import InvalidRequest
from tokentape.gateway.sessions import check_session_id
from tokentape.ray.asgi import App, HttpRequest, ResponseStart, collect, read_body, run_app
from tokentape.server.auth import offered_key, session_of_key
from tokentape.server.dialects.registry import PATHS
from tokentape.server.middleware import DEFAULT_MAX_BODY_BYTES, reject
from tokentape.server.session_names import named_session
from tokentape.store.scan import encode_cursor

__all__ = ["OwnerRouting", "Peers", "session_of", "merge_atropos_rows"]

_SESSION_PATH = re.compile(r"^/sessions/([^/]+)(/.*)?$")
# Routes whose JSON body may name the session (`session_id`, as OpenRLHF agents send it): every dialect's.
_BODY_NAMED = PATHS


class Peers(Protocol):
    """What routing needs to know of the cluster."""

    @property
    def self_index(self) -> int | None: ...  # None: this process owns no session (the front)

    async def owner(self, session_id: str, group_id: str | None = None) -> int:
        """The gateway that owns the session, placing it if it is new."""
        ...

    async def least_loaded(self) -> int: ...

    async def gateways(self) -> dict[int, str]: ...  # index -> base URL

    def forward(self, index: int, request: HttpRequest) -> AsyncIterator[ResponseStart | bytes]: ...

    async def finished(self, session_id: str) -> None: ...

    async def forget(self, session_id: str) -> None: ...


def session_of(request: HttpRequest) -> str | None:
    """The session a request names, read as every gateway reads it (`server.session_names`): the
    body is parsed once, and only on a generation route; a name the owner would refuse is None here
    (any gateway answers it with the same 400)."""
    if match := _SESSION_PATH.match(request.path):
        return match.group(1)
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
    body: dict[str, Any] | None = None
    if request.method == "POST" and request.path.endswith(_BODY_NAMED) and request.body[:1] == b"{":
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(request.body)
            body = parsed if isinstance(parsed, dict) else None
    try:
        return named_session(None, headers, body).session_id
    except InvalidRequest:
        return None


def _valid(session_id: str | None) -> bool:
    try:
        return session_id is not None and bool(check_session_id(session_id))
    except InvalidRequest:
        return False


def merge_atropos_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Atropos rows are one per group; a group whose sessions sit in several shards arrives as
    several rows and leaves as one. Every per-member field (a list as long as `session_ids`) is
    joined in the same order, so members stay aligned across all of them."""
    merged: dict[Any, dict[str, Any]] = {}
    for row in rows:
        members = len(row.get("session_ids", ()))
        per_member = [k for k, v in row.items() if isinstance(v, list) and len(v) == members]
        into = merged.get(row["group_id"])
        if into is None:
            merged[row["group_id"]] = {**row, **{name: list(row[name]) for name in per_member}}
        else:
            for name in per_member:
                into[name].extend(row[name])
    return list(merged.values())


def _json_response(status: int, body: dict[str, Any]) -> tuple[ResponseStart, bytes]:
    data = orjson.dumps(body)
    return ResponseStart(status, ((b"content-type", b"application/json"), (b"content-length", b"%d" % len(data)))), data


class OwnerRouting:
    def __init__(
        self,
        app: App | None,
        peers: Peers,
        *,
        on_finish: Callable[[str], Awaitable[None]] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.app = app  # None in the front process
        self.peers = peers
        self.on_finish = on_finish
        # the body is read here, before the app's own limit could apply: the same limit, applied first
        self.max_body_bytes = max_body_bytes
        self._background: set[asyncio.Task[None]] = set()

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            if self.app is not None:
                await self.app(scope, receive, send)
            elif scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        too_large = declared.isdigit() and int(declared) > self.max_body_bytes
        body, gone = (None, False) if too_large else await read_body(receive, self.max_body_bytes)
        if gone:
            return
        if body is None:
            await reject(
                scope, send, 413, f"the request body exceeds {self.max_body_bytes} bytes", None, "request_too_large"
            )
            return
        request = HttpRequest.from_scope(scope, body)
        parts = self.route(request)

        async def respond() -> None:
            async for part in parts:
                if isinstance(part, ResponseStart):
                    await send({"type": "http.response.start", "status": part.status, "headers": list(part.headers)})
                else:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def client_left() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        responding, watching = asyncio.create_task(respond()), asyncio.create_task(client_left())
        try:
            await asyncio.wait({responding, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (responding, watching):
                task.cancel()  # the client left: stop relaying
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await responding
            await parts.aclose()  # type: ignore[attr-defined]  # the owner's app sees the disconnect

    async def route(self, request: HttpRequest) -> AsyncIterator[ResponseStart | bytes]:
        keyed = session_of_key(offered_key(request.header(b"authorization"), request.header(b"x-api-key")))
        if keyed is not None:  # a session key is checked, and allowed or refused, where its session lives
            async for part in self._at(await self.peers.owner(keyed), request):
                yield part
            return
        if request.method == "GET" and request.path in ("/sessions", "/export"):
            async for part in self._gather(request):
                yield part
            return
        if request.method == "POST" and request.path == "/sessions":
            async for part in self._create(request):
                yield part
            return
        named = session_of(request)
        if named is not None and _valid(named):
            index = await self.peers.owner(named)
        else:  # a new one-call session, or a bad id that any gateway answers with the same 400
            index = await self._nearest()
        async for part in self._at(index, request):
            yield part
        if named is not None and request.method == "DELETE" and request.path == f"/sessions/{named}":
            await self.peers.forget(named)

    async def _nearest(self) -> int:
        """This gateway; in the front, which owns none, the least-loaded one."""
        index = self.peers.self_index
        return index if index is not None else await self.peers.least_loaded()

    def _at(self, index: int, request: HttpRequest) -> AsyncIterator[ResponseStart | bytes]:
        return self.local(request) if index == self.peers.self_index else self.peers.forward(index, request)

    async def local(
        self, request: HttpRequest, gone: asyncio.Event | None = None
    ) -> AsyncIterator[ResponseStart | bytes]:
        """This gateway's own answer (also what a forwarded request runs; `gone` is set when the
        forwarding gateway's client leaves)."""
        assert self.app is not None, "the front process owns no session"
        match = _SESSION_PATH.match(request.path)
        if not (request.method == "POST" and match and match.group(2) == "/finish"):
            async for part in run_app(self.app, request, gone):
                yield part
            return
        # A finish is answered only once the session is handed over (back-pressure from a full
        # queue reaches the finishing client), and the hand-off runs to its end even if that
        # client leaves: the session is finished either way.
        start, body = await collect(run_app(self.app, request))
        if start.status == 200:
            handing = asyncio.get_running_loop().create_task(self._finished(match.group(1)))
            self._background.add(handing)  # the loop keeps only a weak reference to a task
            handing.add_done_callback(self._background.discard)
            await asyncio.shield(handing)
        yield start
        yield body

    async def _finished(self, session_id: str) -> None:
        await self.peers.finished(session_id)
        if self.on_finish is not None:
            await self.on_finish(session_id)

    async def _create(self, request: HttpRequest) -> AsyncIterator[ResponseStart | bytes]:
        try:
            data = orjson.loads(request.body) if request.body.strip() else {}
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("session_id", ""), str):
            async for part in self._at(await self._nearest(), request):  # the gateway's own 400
                yield part
            return
        session_id = data.setdefault("session_id", f"s-{uuid.uuid4().hex}")
        if not _valid(session_id):
            index = await self._nearest()
        else:
            group = data.get("group_id")
            index = await self.peers.owner(session_id, group if isinstance(group, str) else None)
        start, body = await collect(self._at(index, request.with_body(orjson.dumps(data))))
        if start.status == 201:  # tell the agent where its session lives
            url = (await self.peers.gateways())[index]
            created = orjson.loads(body)
            created["base_url"] = f"{url}/sessions/{session_id}/v1"
            start, body = _json_response(201, created)
        yield start
        yield body

    async def _gather(self, request: HttpRequest) -> AsyncIterator[ResponseStart | bytes]:
        indices = sorted(await self.peers.gateways())
        query = {k: v[-1] for k, v in parse_qs(request.query_string.decode("latin-1")).items()}
        if request.path == "/sessions":
            # every shard lists in (created_at, session_id) order from the same cursor: the first
            # `limit` of their merged pages are the cluster's page
            listed: list[Any] = []
            more = False
            for index in indices:
                start, body = await collect(self._at(index, request))
                if start.status != 200:
                    yield start
                    yield body
                    return
                page = orjson.loads(body)
                listed.extend(page["data"])
                more = more or bool(page.get("has_more"))
            listed.sort(key=lambda row: (row.get("created_at") or 0.0, row["session_id"]))
            next_cursor = None
            if "limit" in query:
                size = int(query["limit"])  # every shard accepted it
                more = more or len(listed) > size
                listed = listed[:size]
                if more and listed:
                    next_cursor = encode_cursor((listed[-1]["created_at"], listed[-1]["session_id"]))
            page_body = {"object": "list", "data": listed, "has_more": more, "next_cursor": next_cursor}
            start, data = _json_response(200, page_body)
            yield start
            yield data
            return
        output, fmt = query.get("output", "json"), query.get("format", "tokentape")
        shard_query = urlencode({**query, "output": "jsonl"}).encode()
        shard_request = HttpRequest("GET", "/export", shard_query, request.headers, b"")
        rows = self._shard_rows(indices, shard_request)
        first = await anext(rows)
        if not isinstance(first, dict):
            if isinstance(first, ResponseStart) and first.status == 200:  # no rows in any shard
                async for part in self._written([], fmt, output):
                    yield part
                return
            yield first  # a bad query: every shard answers the same error
            async for rest in rows:
                if not isinstance(rest, dict):
                    yield rest
            return
        if fmt == "atropos" or output == "parquet":  # whole groups / one file: gathered, then written
            everything = [first, *[row async for row in rows if isinstance(row, dict)]]
            if fmt == "atropos":
                everything = merge_atropos_rows(everything)
            async for part in self._written(everything, fmt, output):
                yield part
            return
        media = b"application/x-ndjson" if output == "jsonl" else b"application/json"
        yield ResponseStart(200, ((b"content-type", media),))
        if output == "jsonl":
            yield orjson.dumps(first) + b"\n"
            async for row in rows:
                if isinstance(row, dict):
                    yield orjson.dumps(row) + b"\n"
            return
        yield b'{"object":"list","format":' + orjson.dumps(fmt) + b',"data":[' + orjson.dumps(first)
        async for row in rows:
            if isinstance(row, dict):
                yield b"," + orjson.dumps(row)
        yield b"]}"

    async def _shard_rows(
        self, indices: list[int], request: HttpRequest
    ) -> AsyncIterator[dict[str, Any] | ResponseStart | bytes]:
        """Every shard's rows, one at a time; a shard's error response instead, as it came."""
        yielded = False
        for index in indices:
            pending = b""
            parts = self._at(index, request)
            async for part in parts:
                if isinstance(part, ResponseStart):
                    if part.status != 200:
                        yield part
                        async for rest in parts:
                            yield rest
                        return
                    continue
                pending += part
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yielded = True
                        yield orjson.loads(line)
            if pending.strip():
                yielded = True
                yield orjson.loads(pending)
        if not yielded:
            yield ResponseStart(200)  # marks "no rows"

    async def _written(self, rows: list[dict[str, Any]], fmt: str, output: str) -> AsyncIterator[ResponseStart | bytes]:
        from tokentape.core.formats import check_format
        from tokentape.store.datasets import to_jsonl_bytes, to_parquet_bytes

        if output == "parquet":
            data, media = to_parquet_bytes(rows, check_format(fmt)), b"application/vnd.apache.parquet"
        elif output == "jsonl":
            data, media = to_jsonl_bytes(rows), b"application/x-ndjson"
        else:
            data, media = orjson.dumps({"object": "list", "format": fmt, "data": rows}), b"application/json"
        yield ResponseStart(200, ((b"content-type", media), (b"content-length", b"%d" % len(data))))
        yield data

"""Session routes: list (paged), create (with group and metadata; it answers the session's own key
for its agent, and its base URL), inspect, reward, finish, export
one or many (in a trainer's format, as JSON, JSONL or Parquet, streamed from the store a page at a
time), delete."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from tokentape.core.export import export_session
from tokentape.core.formats import check_format, format_rows, samples_of
from tokentape.core.images import DecodedImage
from tokentape.core.outcome import MAX_METADATA_BYTES, check_reward
from tokentape.core.rollouts import Weighting, check_weighting
from tokentape.core.session import SessionTree
from tokentape.core.staleness import LagMode, LagWindow, lag_filter
from tokentape.errors import InvalidRequest
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import Session, check_policy
from tokentape.server.bodies import json_object
from tokentape.server.errors import json_response
from tokentape.server.keys import SessionKeys
from tokentape.store.datasets import to_jsonl_bytes, to_parquet_bytes
from tokentape.store.export import MEDIA_TYPES, OUTPUTS, Output, dataset_pages, encode_dataset, started
from tokentape.store.scan import SessionFilter, StoredSession, decode_cursor, encode_cursor
from tokentape.viewer import page

__all__ = ["add_session_routes"]

MAX_PAGE = 1000  # sessions per page of GET /sessions: each is loaded to summarize it


def _optional_str(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"{key} must be a string", param=key)
    return value


def _metadata(data: dict[str, Any]) -> dict[str, Any]:
    value = data.get("metadata") or {}
    if not isinstance(value, dict):
        raise InvalidRequest("metadata must be an object", param="metadata")
    if len(orjson.dumps(value)) > MAX_METADATA_BYTES:
        raise InvalidRequest(f"metadata is limited to {MAX_METADATA_BYTES} bytes of JSON", param="metadata")
    return value


def _max_staleness(data: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """The session's own bounded staleness: `max_staleness` (or, as before, `metadata.max_staleness`),
    a whole number >= 0; kept in the metadata, where the gateway reads it on every turn."""
    values = {"max_staleness": data.get("max_staleness"), "metadata.max_staleness": metadata.get("max_staleness")}
    for param, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InvalidRequest(f"{param} must be a whole number of versions, 0 or more", param=param)
    field, nested = values["max_staleness"], values["metadata.max_staleness"]
    if field is not None and nested is not None and field != nested:
        raise InvalidRequest("max_staleness and metadata.max_staleness differ; send one", param="max_staleness")
    return metadata if field is None else {**metadata, "max_staleness": field}


def _flag(value: str | None, param: str) -> bool | None:
    if value is None:
        return None
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise InvalidRequest(f"{param} must be true or false", param=param)


def _time(value: str | None, param: str) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidRequest(f"{param} must be a Unix time in seconds", param=param) from None


def _output(value: str) -> Output:
    for known in OUTPUTS:
        if value == known:
            return known
    raise InvalidRequest(f"output must be one of {', '.join(OUTPUTS)}", param="output")


def _limit(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be a whole number from 1 to {MAX_PAGE}", param="limit")
    return limit


def _lag(max_lag: str | None, lag_mode: str | None, current: int, fmt: str | None) -> LagWindow | None:
    """An export's `max_lag` (tokens sampled under a version older than `current - max_lag` are too
    old) and `lag_mode` (`drop` the sample, the default, or `mask` those tokens out of the loss),
    checked before anything is read: a bad value is a 400, never a half-written export."""
    if max_lag is None:
        if lag_mode is not None:
            raise InvalidRequest("lag_mode needs max_lag", param="lag_mode")
        return None
    try:
        lag = int(max_lag)
    except ValueError:
        lag = -1
    if lag < 0:
        raise InvalidRequest("max_lag must be a whole number of versions, 0 or more", param="max_lag")
    mode: LagMode
    if lag_mode is None or lag_mode == "drop":
        mode = "drop"
    elif lag_mode == "mask":
        mode = "mask"
    else:
        raise InvalidRequest("lag_mode must be drop or mask", param="lag_mode")
    if mode == "mask" and fmt not in (None, "tokentape", "verifiers"):
        raise InvalidRequest("lag_mode mask needs a per-token mask: format tokentape or verifiers", param="lag_mode")
    return LagWindow(current, lag, mode)


def _side_calls(value: str | None) -> bool | None:
    """The export's `side_calls`: absent or false leaves them out (False), true takes all (None),
    only takes them alone (True)."""
    if value is None or value == "false":
        return False
    if value == "true":
        return None
    if value == "only":
        return True
    raise InvalidRequest("side_calls must be true, false or only", param="side_calls")


def _rows_response(
    trees: list[SessionTree],
    fmt_name: str,
    output: str,
    lag: LagWindow | None = None,
    weighting: Weighting = "rows",
    images: Mapping[str, DecodedImage] | None = None,
) -> Response:
    fmt = check_format(fmt_name)
    _output(output)
    rows = format_rows(samples_of(trees, images), fmt, lag=lag, weighting=weighting)
    if output == "jsonl":
        return Response(to_jsonl_bytes(rows), media_type="application/x-ndjson")
    if output == "parquet":
        return Response(to_parquet_bytes(rows, fmt), media_type="application/vnd.apache.parquet")
    return json_response({"object": "list", "format": fmt, "data": rows})


def add_session_routes(
    app: FastAPI, gateway: Gateway, keys: SessionKeys | None = None, forget: Callable[[str], None] | None = None
) -> None:
    """`forget`: told each session that is finished or deleted (what the routes keep of its last body)."""
    sessions = gateway.sessions
    keys = keys or SessionKeys(sessions)

    @app.get("/sessions")
    async def list_sessions(limit: str | None = None, cursor: str | None = None) -> Response:
        """Stored sessions, oldest first. With `limit`, one page: `has_more`, and `next_cursor` to
        pass as `cursor` for the next. Without, every session, streamed. A session whose stored
        rows cannot be read is listed with an `error` instead of its summary."""
        page_size, after = _limit(limit), decode_cursor(cursor) if cursor is not None else None
        if page_size is None:

            async def everything() -> AsyncIterator[bytes]:
                yield b'{"object":"list","data":['
                first = True
                async for stored in sessions.scan(after=after):
                    yield (b"" if first else b",") + orjson.dumps(sessions.summary(stored))
                    first = False
                yield b'],"has_more":false,"next_cursor":null}'

            return StreamingResponse(everything(), media_type="application/json")
        listed: list[StoredSession] = []
        async for stored in sessions.scan(after=after, page_size=page_size + 1):
            listed.append(stored)
            if len(listed) > page_size:
                break
        more = len(listed) > page_size
        listed = listed[:page_size]
        return json_response(
            {
                "object": "list",
                "data": [sessions.summary(s) for s in listed],
                "has_more": more,
                "next_cursor": encode_cursor(listed[-1].key) if more else None,
            }
        )

    @app.post("/sessions", status_code=201)
    async def create_session(request: Request) -> dict[str, Any]:
        """Open a session; every field is optional: `session_id` (else one is made), `group_id`,
        `metadata`, `rewrite_policy`, `max_staleness`, `reward`. Answers 201 with its summary, its
        own `api_key` (shown this once) and the `base_url` its agent calls; 400 `session_exists` if
        the id is taken."""
        data = await json_object(request, optional=True)
        session_id = _optional_str(data, "session_id")
        policy = _optional_str(data, "rewrite_policy")
        group_id = _optional_str(data, "group_id")
        metadata = _max_staleness(data, _metadata(data))
        reward = data.get("reward")
        if reward is not None:
            check_reward(reward, "reward")
        # check and create in one step: of two creates of one id at once, one creates it and gets its key
        session, created = await sessions.open(session_id, check_policy(policy) if policy is not None else None)
        if not created:
            raise InvalidRequest(f"session {session_id!r} already exists", param="session_id", code="session_exists")
        outcome = session.tree.outcome
        outcome.group_id, outcome.metadata = group_id, metadata
        if reward is not None:
            outcome.set_rewards(reward=reward, turn_ids=set(), branch_ids=set())
        # the session's own key, for its agent: answered here once, stored only as a digest
        api_key = await keys.issue(session.tree)
        base_url = f"{str(request.base_url).rstrip('/')}/sessions/{session.id}/v1"
        return {**session.summary(), "api_key": api_key, "base_url": base_url}

    @app.get("/sessions/{session_id}")
    async def get_session(session_id: str) -> dict[str, Any]:
        """One session's summary (turns, branches, tokens, rewards, finished) and its rewrite events;
        404 if there is none. The tokens themselves: its export."""
        session = await sessions.get(session_id)
        return {**session.summary(), "rewrite_events": [r.as_dict() for r in session.tree.rewrites]}

    @app.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> dict[str, Any]:
        """Set the episode's reward, and optionally per-branch (`branch_rewards`) and per-turn
        (`turn_rewards`) ones, keyed by the ids the export shows."""
        session = await sessions.get(session_id)
        data = await json_object(request)
        for key in ("branch_rewards", "turn_rewards"):
            if data.get(key) is not None and not isinstance(data[key], dict):
                raise InvalidRequest(f"{key} must be an object of id -> number", param=key)
        if all(data.get(k) is None for k in ("reward", "branch_rewards", "turn_rewards")):
            raise InvalidRequest("send reward, branch_rewards or turn_rewards", param="reward")
        tree = session.tree
        tree.outcome.set_rewards(
            reward=data.get("reward"),
            branch_rewards=data.get("branch_rewards"),
            turn_rewards=data.get("turn_rewards"),
            turn_ids={n.id for n in tree.nodes},
            branch_ids={leaf.id for leaf in tree.leaves},
        )
        await sessions.persist(session)
        return session.summary()

    @app.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict[str, Any]:
        """Freeze the session: later turns get 409; rewards can still be set. An optional body
        `{"metadata": {...}}` is merged into the session's metadata."""
        session = await sessions.get(session_id)
        data = await json_object(request, optional=True)
        metadata = {**session.tree.outcome.metadata, **_metadata(data)}
        if len(orjson.dumps(metadata)) > MAX_METADATA_BYTES:
            raise InvalidRequest(f"metadata is limited to {MAX_METADATA_BYTES} bytes of JSON", param="metadata")
        session.tree.outcome.metadata = metadata
        for side in sessions.side_sessions(session_id):  # a harness's side calls end with its episode
            await _finish(side)
        await _finish(session)
        return session.summary()

    async def _finish(session: Session) -> None:
        newly = not session.tree.outcome.finished
        session.finish()
        await sessions.persist(session)
        keys.revoke(session.id)
        if forget is not None:
            forget(session.id)
        if newly:
            gateway.metrics.session_finished()

    @app.get("/sessions/{session_id}/export")
    async def export(
        session_id: str,
        format: str | None = None,
        output: str = "json",
        texts: bool = False,
        max_lag: str | None = None,
        lag_mode: str | None = None,
        weighting: str = "rows",
    ) -> Response:
        """One session. Without `format`: the native export; `texts=true` adds each token's text.
        `max_lag` (with `lag_mode` drop or mask) filters against the gateway's current version;
        `weighting` (rows, tokens, none) splits the session's one vote over its rows (`loss_weight`)."""
        lag = _lag(max_lag, lag_mode, gateway.gate.version, format and check_format(format))
        rule = check_weighting(weighting)
        tree = (await sessions.get(session_id)).tree
        images = await sessions.images.of_trees([tree]) if tree.images else None  # bytes from the store
        if format is None:
            exported = export_session(tree, images)
            if lag is not None:
                kept = (lag_filter(b, lag.current, lag.max_lag, lag.mode) for b in exported["branches"])
                exported["branches"] = [b for b in kept if b is not None]
            if texts:
                tokenizer = gateway.renderer.tokenizer
                for branch in exported["branches"]:
                    branch["token_texts"] = [tokenizer.decode_all([t]) for t in branch["tokens"]]
            return json_response(exported)
        return _rows_response([tree], format, output, lag, rule, images)

    @app.get("/view", response_class=HTMLResponse)
    async def view() -> str:
        """The token-level viewer of this gateway's sessions."""
        return page()

    @app.get("/export")
    async def export_many(
        format: str = "tokentape",
        output: str = "json",
        group_id: str | None = None,
        finished: str | None = None,
        since: str | None = None,
        until: str | None = None,
        prefix: str | None = None,
        max_lag: str | None = None,
        lag_mode: str | None = None,
        weighting: str = "rows",
        side_calls: str | None = None,
    ) -> Response:
        """Many sessions as a dataset (formats: tokentape, openrlhf, atropos, verifiers, stepwise,
        packed; outputs: json, jsonl, parquet), filtered by group, finished state, creation time and
        session id prefix, and by `max_lag` (`lag_mode` drop or mask) against the gateway's current
        version; `weighting` (rows, tokens, none) splits each session's one vote over its rows. A
        harness's side calls (titles, summaries, subagents: sessions marked `side_of`) are left out
        unless `side_calls=true` (with the episodes) or `only` (they alone)."""
        where = SessionFilter(
            group_id=group_id,
            finished=_flag(finished, "finished"),
            since=_time(since, "since"),
            until=_time(until, "until"),
            prefix=prefix,
            side_calls=_side_calls(side_calls),
        )
        fmt, out = check_format(format), _output(output)
        lag = _lag(max_lag, lag_mode, gateway.gate.version, fmt)
        rule = check_weighting(weighting)
        skipped: list[StoredSession] = []
        pages = dataset_pages(
            lambda w: sessions.scan(w), where, fmt, skipped, lag=lag, weighting=rule, images=sessions.images.of_trees
        )
        # made up to its first chunk here: a failure before the first byte is an error response
        body = await started(encode_dataset(pages, fmt, out, skipped))
        return StreamingResponse(body, media_type=MEDIA_TYPES[out])

    @app.delete("/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        """Delete a session from memory and from the store, and revoke its key; 404 if there is none."""
        await sessions.delete(session_id)
        keys.revoke(session_id)
        if forget is not None:
            forget(session_id)
        return {"id": session_id, "object": "session", "deleted": True, "at": time.time()}

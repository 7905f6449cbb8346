"""Datasets streamed from stored sessions: rows are formatted a page of sessions at a time and
encoded as they come (a JSON list, JSON lines, or Parquet row groups), so an export of any size
holds one page in memory, not every session.

The sessions come from a `Scan`: any function that yields stored sessions matching a filter in key
order, such as one store's `scan` or `merge` over several stores' scans. A session that cannot be
read is skipped and reported in `skipped`; the others are exported.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

import orjson

from tokentape.core.export import EXPORT_SCHEMA_VERSION
from tokentape.core.formats import Format, format_rows, samples_of
from tokentape.core.images import DecodedImage
from tokentape.core.rollouts import Weighting
from tokentape.core.session import SessionTree
from tokentape.core.staleness import LagWindow
from tokentape.errors import TokentapeError
from tokentape.store.columns import parquet_schema, parquet_values
from tokentape.store.scan import SessionFilter, StoredSession

__all__ = [
    "ImageReader",
    "Output",
    "OUTPUTS",
    "Scan",
    "dataset_pages",
    "encode_dataset",
    "MEDIA_TYPES",
    "started",
]

log = logging.getLogger("tokentape.store")

Output = Literal["json", "jsonl", "parquet"]
OUTPUTS: tuple[Output, ...] = ("json", "jsonl", "parquet")
MEDIA_TYPES = {"json": "application/json", "jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}
Scan = Callable[[SessionFilter], AsyncIterator[StoredSession]]
# the bytes of the images some sessions show, by digest (`ImageLibrary.of_trees`): trees hold facts only
ImageReader = Callable[[list[SessionTree]], Awaitable[Mapping[str, DecodedImage]]]
SESSIONS_PER_PAGE = 64  # sessions formatted together: bounds an export's memory


async def _trees(scan: AsyncIterator[StoredSession], skipped: list[StoredSession]) -> AsyncIterator[SessionTree]:
    async for stored in scan:
        if stored.tree is None:
            skipped.append(stored)
        else:
            yield stored.tree


async def dataset_pages(
    scan: Scan,
    where: SessionFilter,
    fmt: Format,
    skipped: list[StoredSession],
    *,
    lag: LagWindow | None = None,
    weighting: Weighting = "rows",
    images: ImageReader | None = None,
) -> AsyncIterator[list[dict[str, Any]]]:
    """The rows of a dataset, a page at a time, in the order of the sessions. Atropos and packed rows
    are whole groups: the first session of a group brings its whole group (read with the group's own
    filter), so a group is never split across pages. `lag`: an export's max_lag (`format_rows`).
    `images`: reads the bytes of a page's images (needed as soon as a session shows one)."""

    async def rows(trees: list[SessionTree]) -> list[dict[str, Any]]:
        shown = await images(trees) if images is not None and any(tree.images for tree in trees) else None
        return format_rows(samples_of(trees, shown), fmt, lag=lag, weighting=weighting)

    page: list[SessionTree] = []
    emitted_groups: set[str] = set()
    async for tree in _trees(scan(where), skipped):
        group_id = tree.outcome.group_id
        if fmt in ("atropos", "packed") and group_id is not None:
            if group_id in emitted_groups:
                continue
            emitted_groups.add(group_id)
            if page:
                yield await rows(page)
                page = []
            group_scan = scan(dataclasses.replace(where, group_id=group_id))
            members = [member async for member in _trees(group_scan, [])]
            yield await rows(members)
            continue
        page.append(tree)
        if len(page) >= SESSIONS_PER_PAGE:
            yield await rows(page)
            page = []
    if page:
        yield await rows(page)


def _skipped_json(skipped: list[StoredSession]) -> bytes:
    return orjson.dumps([{"session_id": s.session_id, "error": s.error} for s in skipped])


async def encode_dataset(
    pages: AsyncIterator[list[dict[str, Any]]], fmt: Format, output: Output, skipped: list[StoredSession]
) -> AsyncIterator[bytes]:
    """Bytes of the dataset as pages arrive. JSON: `{"object": "list", "format", "data": [...],
    "skipped": [{"session_id", "error"}]}`; JSON lines: one row per line; Parquet: one row group
    per page or more, typed by the format's schema (`store.columns`), with the schema version and
    format in the file's metadata.

    Nothing is yielded before the first page is encoded, so a failure there raises before the
    first byte (`started` turns it into an error response). A failure after it ends the body with
    an error trailer, never silently short: JSON lines, a last line `{"error": {...}}` (no row has
    that field); JSON, `"error": {...}` in place of `skipped`; Parquet, the line `{"error": {...}}`
    where the footer would be, so no Parquet reader takes the file."""
    sent = False
    try:
        async for chunk in _encoded(pages, fmt, output, skipped):
            sent = sent or bool(chunk)
            yield chunk
    except Exception as exc:
        if not sent:
            raise
        log.exception("an export failed after its first byte; its body ends with an error trailer")
        error = orjson.dumps(_trailer_error(exc))
        if output == "json":
            yield b'],"error":' + error + b"}"
        else:  # JSON lines end each row with a newline; Parquet bytes do not
            yield (b"" if output == "jsonl" else b"\n") + b'{"error":' + error + b"}\n"


def _trailer_error(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, TokentapeError):
        return {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}
    message = f"the export failed before its end ({type(exc).__name__}: {exc}); what came before is incomplete"
    return {"message": message, "type": "server_error", "param": None, "code": "export_failed"}


async def started(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`chunks` with its first chunk already made: what fails before the first byte raises here,
    before any response has started."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = b""

    async def rest() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    return rest()


async def _encoded(
    pages: AsyncIterator[list[dict[str, Any]]], fmt: Format, output: Output, skipped: list[StoredSession]
) -> AsyncIterator[bytes]:
    if output == "parquet":
        async for chunk in _parquet(pages, fmt):
            yield chunk
        return
    if output == "jsonl":
        async for rows in pages:
            if rows:
                yield b"".join(orjson.dumps(row) + b"\n" for row in rows)
        return
    head = b'{"object":"list","format":' + orjson.dumps(fmt) + b',"data":['
    async for rows in pages:  # the head goes out with the first rows
        if rows:
            yield (head or b",") + b",".join(orjson.dumps(row) for row in rows)
            head = b""
    yield head + b'],"skipped":' + _skipped_json(skipped) + b"}"


class _Chunks(io.RawIOBase):
    """A write-only file that keeps what is written until it is drained."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[bytes] = []
        self._position = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        self._position += len(data)
        return len(data)

    def tell(self) -> int:
        return self._position

    def drain(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


async def _parquet(pages: AsyncIterator[list[dict[str, Any]]], fmt: Format) -> AsyncIterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    metadata = {"tokentape.schema_version": str(EXPORT_SCHEMA_VERSION), "tokentape.format": fmt}
    schema = parquet_schema(fmt, metadata)  # the format's, whatever rows come first or last
    sink = _Chunks()
    writer = pq.ParquetWriter(sink, schema)

    def write(rows: list[dict[str, Any]]) -> bytes:
        writer.write_table(pa.Table.from_pylist(parquet_values(rows, schema), schema=schema))
        return sink.drain()

    async for rows in pages:
        if rows:
            chunk = await asyncio.to_thread(write, rows)
            if chunk:
                yield chunk
    writer.close()
    yield sink.drain()

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
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import orjson

from tokentape.core.export import EXPORT_SCHEMA_VERSION
from tokentape.core.formats import Format, format_rows, samples_of
from tokentape.core.images import DecodedImage
from tokentape.core.rollouts import Weighting
from tokentape.core.session import SessionTree
from tokentape.core.staleness import LagWindow
from tokentape.store.scan import SessionFilter, StoredSession

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["ImageReader", "Output", "OUTPUTS", "Scan", "dataset_pages", "encode_dataset", "MEDIA_TYPES"]

log = logging.getLogger("tokentape.store")

Output = Literal["json", "jsonl", "parquet"]
OUTPUTS: tuple[Output, ...] = ("json", "jsonl", "parquet")
MEDIA_TYPES = {"json": "application/json", "jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}
Scan = Callable[[SessionFilter], AsyncIterator[StoredSession]]
# the bytes of the images some sessions show, by digest (`ImageLibrary.of_trees`): trees hold facts only
ImageReader = Callable[[list[SessionTree]], Awaitable[Mapping[str, DecodedImage]]]
SESSIONS_PER_PAGE = 64  # sessions formatted together: bounds an export's memory
PARQUET_TYPING_ROWS = 1024  # rows held back, at most, to learn each Parquet column's type
_FLOAT_FIELDS = frozenset(
    {
        "reward",
        "scores",
        "turn_rewards",
        "logprobs",
        "rollout_log_probs",
        "completion_logprobs",
        "inference_logprobs",
        "loss_weight",
        "loss_weights",
        "loss_coefficient",
        "rewards",
    }
)


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
    per page or more, with the schema version and format in the file's metadata."""
    if output == "parquet":
        async for chunk in _parquet(pages, fmt):
            yield chunk
        return
    if output == "jsonl":
        async for rows in pages:
            if rows:
                yield b"".join(orjson.dumps(row) + b"\n" for row in rows)
        return
    yield b'{"object":"list","format":' + orjson.dumps(fmt) + b',"data":['
    first = True
    async for rows in pages:
        if rows:
            yield (b"" if first else b",") + b",".join(orjson.dumps(row) for row in rows)
            first = False
    yield b'],"skipped":' + _skipped_json(skipped) + b"}"


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


def _flat(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # metadata is a free-form object: JSON text in Parquet, whose columns need one type
    return [{**row, "metadata": json.dumps(row["metadata"])} if "metadata" in row else row for row in rows]


def _settled_type(name: str, kind: pa.DataType) -> pa.DataType:
    """A column's type for the whole file: floats where the format has numbers that may be
    integers or missing on the first rows, text where every value seen so far was null."""
    import pyarrow as pa

    if pa.types.is_list(kind):
        return pa.list_(_settled_type(name, kind.value_type))
    if name in _FLOAT_FIELDS:
        return pa.float64()
    return pa.string() if pa.types.is_null(kind) else kind


def _has_null_column(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return _has_null_column(kind.value_type) if pa.types.is_list(kind) else pa.types.is_null(kind)


def _types_unknown(rows: list[dict[str, Any]]) -> bool:
    import pyarrow as pa

    return not rows or any(_has_null_column(f.type) for f in pa.Table.from_pylist(rows).schema)


async def _parquet(pages: AsyncIterator[list[dict[str, Any]]], fmt: Format) -> AsyncIterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    metadata = {"tokentape.schema_version": str(EXPORT_SCHEMA_VERSION), "tokentape.format": fmt}
    sink = _Chunks()
    writer: pq.ParquetWriter | None = None
    schema: pa.Schema | None = None
    held: list[dict[str, Any]] = []

    def write(rows: list[dict[str, Any]]) -> bytes:
        nonlocal writer, schema
        if schema is None:
            inferred = pa.Table.from_pylist(rows).schema
            fields = [pa.field(f.name, _settled_type(f.name, f.type)) for f in inferred]
            schema = pa.schema(fields).with_metadata(metadata)
            writer = pq.ParquetWriter(sink, schema)
        assert writer is not None
        writer.write_table(pa.Table.from_pylist(rows, schema=schema))
        return sink.drain()

    async for rows in pages:
        held += _flat(rows)
        if schema is None and len(held) < PARQUET_TYPING_ROWS and _types_unknown(held):
            continue  # some column's type is not known yet
        chunk = await asyncio.to_thread(write, held)
        held = []
        if chunk:
            yield chunk
    if held:
        yield await asyncio.to_thread(write, held)
    if writer is None:  # no rows at all: an empty table, still with the metadata
        writer = pq.ParquetWriter(sink, pa.schema([]).with_metadata(metadata))
    writer.close()
    yield sink.drain()

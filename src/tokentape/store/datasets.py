"""Datasets of many sessions as JSONL or Parquet files, with the schema version in each row (and in
the Parquet file's metadata). Parquet columns are typed by the format's schema (`store.columns`);
its free-form objects (`metadata`, `sampling`, `policy_spans`) are JSON text there, parsed again by
`read_dataset`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from tokentape.core.export import EXPORT_SCHEMA_VERSION
from tokentape.core.formats import Format
from tokentape.errors import InvalidRequest
from tokentape.store.columns import OPTIONAL_COLUMNS, parquet_schema, parquet_values

__all__ = [
    "DATASET_SUFFIXES",
    "parquet_rows",
    "read_dataset",
    "to_jsonl_bytes",
    "to_parquet_bytes",
    "write_dataset",
]

if TYPE_CHECKING:
    import pyarrow as pa

DATASET_SUFFIXES = (".jsonl", ".parquet")


def to_jsonl_bytes(rows: Sequence[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def to_parquet_bytes(rows: Sequence[dict[str, Any]], fmt: Format) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    metadata = {"tokentape.schema_version": str(EXPORT_SCHEMA_VERSION), "tokentape.format": fmt}
    schema = parquet_schema(fmt, metadata)
    table = pa.Table.from_pylist(parquet_values(rows, schema), schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def write_dataset(rows: Sequence[dict[str, Any]], path: Path, fmt: Format) -> Path:
    if path.suffix not in DATASET_SUFFIXES:
        raise InvalidRequest(f"a dataset file ends in {' or '.join(DATASET_SUFFIXES)}", param="out")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(to_jsonl_bytes(rows) if path.suffix == ".jsonl" else to_parquet_bytes(rows, fmt))
    return path


def read_dataset(path: Path) -> list[dict[str, Any]]:
    """Rows back from a dataset file, as its JSON lines would hold them (`parquet_rows`)."""
    if path.suffix == ".jsonl":
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    import pyarrow.parquet as pq

    return parquet_rows(pq.read_table(path))


def parquet_rows(table: pa.Table) -> list[dict[str, Any]]:
    """A Parquet export's rows as its JSON export holds them: the JSON columns the file's metadata
    names parsed again, and the optional columns a row did not hold (null) left out."""
    named = (table.schema.metadata or {}).get(b"tokentape.json_columns")
    json_columns = named.decode().split(",") if named is not None else ["metadata"]  # before the schema named them
    rows: list[dict[str, Any]] = table.to_pylist()
    for row in rows:
        for name in json_columns:
            if isinstance(row.get(name), str):
                row[name] = json.loads(row[name])
        for name in OPTIONAL_COLUMNS:
            if name in row and row[name] is None:
                del row[name]
    return rows

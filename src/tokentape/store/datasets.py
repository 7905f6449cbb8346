"""Datasets of many sessions as JSONL or Parquet files, with the schema version in each row (and in
the Parquet file's metadata). `metadata` is a free-form object: JSON text in Parquet, whose columns
need one type."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from tokentape.core.export import EXPORT_SCHEMA_VERSION
from tokentape.core.formats import Format
from tokentape.errors import InvalidRequest

__all__ = ["write_dataset", "read_dataset", "to_parquet_bytes", "to_jsonl_bytes", "DATASET_SUFFIXES"]

DATASET_SUFFIXES = (".jsonl", ".parquet")


def to_jsonl_bytes(rows: Sequence[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def to_parquet_bytes(rows: Sequence[dict[str, Any]], fmt: Format) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = [{**row, "metadata": json.dumps(row["metadata"])} if "metadata" in row else row for row in rows]
    table = pa.Table.from_pylist(flat)
    table = table.replace_schema_metadata(
        {"tokentape.schema_version": str(EXPORT_SCHEMA_VERSION), "tokentape.format": fmt}
    )
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
    """Rows back from a dataset file (metadata parsed again)."""
    if path.suffix == ".jsonl":
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    for row in rows:
        if isinstance(row.get("metadata"), str):
            row["metadata"] = json.loads(row["metadata"])
    return rows

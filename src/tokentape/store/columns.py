"""The Parquet schema of each dataset format, declared from the rows `core.formats` builds, never
inferred from the rows of one export: a field that first appears on a late row (a turn's logit bias,
a rewrite, an image) has its column from the start, with the type it will hold.

Every field a format's JSON row can hold is a column. A field a row does not hold (the image fields
of a branch without images, `masked_by_lag` outside a masking export) reads as null. Three fields are
free-form objects whose keys come and go with the turn, so they are JSON text, exactly what the JSON
export holds (`json.loads` gives it back): `metadata` (what the trainer attached), `sampling` (per
turn: the temperature and cuts, plus the bias and penalties only where a turn set them) and
`policy_spans` (per turn: its spans, `kv_version` only where one was recorded). The file's metadata
names them (`tokentape.json_columns`). Every other column is typed: int64, float64, string, bool,
their lists, and structs for objects with fixed keys (`rewrites`, `image_runs`).

`check_row` refuses a row with a field its format's schema does not declare: pyarrow would leave it
out silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tokentape.core.formats import Format

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["JSON_COLUMNS", "OPTIONAL_COLUMNS", "check_row", "parquet_schema", "parquet_values"]

JSON_COLUMNS = ("metadata", "sampling", "policy_spans")  # free-form objects: JSON text in Parquet
# fields only some rows hold (a branch's images; `masked_by_lag` in an export that masks by lag):
# null in Parquet where the JSON row has no such field
OPTIONAL_COLUMNS = ("images", "image_grid_thw", "image_runs", "masked_by_lag")


def _columns(fmt: Format) -> dict[str, pa.DataType]:
    import pyarrow as pa

    i64, f64, text, flag = pa.int64(), pa.float64(), pa.string(), pa.bool_()
    ints, floats, texts, flags = pa.list_(i64), pa.list_(f64), pa.list_(text), pa.list_(flag)
    spans = pa.list_(ints)  # [start, end) pairs
    rewrite = pa.struct([("kind", text), ("policy", text), ("at_message", i64), ("at_token", i64), ("detail", text)])
    image_run = pa.struct([("digest", text), ("start", i64), ("end", i64)])
    images = {"images": texts, "image_grid_thw": pa.list_(ints), "image_runs": pa.list_(image_run)}
    versions = {"versions": ints, "param_version_start": i64, "param_version_end": i64, "policy_spans": text}
    head = {  # Sample.head()
        "schema_version": i64,
        "session_id": text,
        "rollout_id": text,
        "branch_id": i64,
        "group_id": text,
        "reward": f64,
        "finished": flag,
        "metadata": text,
        "policy_versions": texts,
        "constrained": flags,
        **versions,
    }
    if fmt == "tokentape":
        return {
            **head,
            "tokens": ints,
            "loss_mask": ints,
            "logprobs": floats,
            "origins": texts,
            "turn_index": ints,
            "action_ranges": spans,
            "finish_reasons": texts,
            "truncated": flag,
            "rewrites": pa.list_(rewrite),
            "turn_ids": ints,
            "trace_ids": texts,
            "logprob_modes": texts,
            "notes": pa.list_(texts),
            "sampling": text,
            **images,
            "logprob_mode": text,
            "turn_rewards": floats,
            "loss_weight": f64,
            "masked_by_lag": i64,
        }
    if fmt == "openrlhf":
        return {
            **head,
            "observation_tokens": ints,
            "action_ranges": spans,
            "rollout_log_probs": floats,
            "truncated": flag,
            **images,
            "loss_weight": f64,
        }
    if fmt == "verifiers":
        return {
            **head,
            "prompt_ids": ints,
            "prompt_mask": ints,
            "completion_ids": ints,
            "completion_mask": ints,
            "completion_logprobs": floats,
            "is_truncated": flag,
            **images,
            "loss_weight": f64,
            "masked_by_lag": i64,
        }
    if fmt == "stepwise":
        return {
            **head,
            "step": i64,
            "turn_id": i64,
            "policy_version": text,
            "completion_versions": ints,
            "constrained": flag,  # the turn's own, where the other formats list every turn's
            "prompt_ids": ints,
            "completion_ids": ints,
            "completion_logprobs": floats,
            "finish_reason": text,
            "loss_weight": f64,
        }
    if fmt == "atropos":
        return {
            "schema_version": i64,
            "group_id": text,
            "session_ids": texts,
            "branch_ids": ints,
            "tokens": pa.list_(ints),
            "masks": pa.list_(ints),
            "inference_logprobs": pa.list_(floats),
            "scores": floats,
            "rollout_ids": texts,
            "loss_weights": floats,
            "policy_versions": pa.list_(texts),
            "versions": pa.list_(ints),
            "param_version_start": ints,
            "param_version_end": ints,
            "policy_spans": text,
            "constrained": pa.list_(flags),
        }
    assert fmt == "packed", fmt
    return {
        "schema_version": i64,
        "group_id": text,
        "session_ids": texts,
        "tokens": ints,
        "parents": ints,
        "position_ids": ints,
        "loss_mask": ints,
        "logprobs": floats,
        "versions": ints,
        "loss_coefficient": floats,
        "branch_ends": ints,
        "branch_ids": ints,
        "rollout_ids": texts,
        "rewards": floats,
        "loss_weights": floats,
        "branch_tokens": i64,
        "param_version_start": i64,
        "param_version_end": i64,
        **images,
    }


def parquet_schema(fmt: Format, metadata: Mapping[str, str] | None = None) -> pa.Schema:
    """The Parquet schema of `fmt`'s rows, with `metadata` and the JSON columns it has named in the
    file's metadata (`tokentape.json_columns`, comma-separated)."""
    import pyarrow as pa

    columns = _columns(fmt)
    named = ",".join(name for name in JSON_COLUMNS if name in columns)
    return pa.schema(list(columns.items())).with_metadata({**(metadata or {}), "tokentape.json_columns": named})


def check_row(row: Mapping[str, Any], schema: pa.Schema) -> None:
    """ValueError naming the fields of `row` that `schema` has no column for."""
    unknown = [name for name in row if schema.get_field_index(name) < 0]
    if unknown:
        raise ValueError(f"the Parquet schema has no column for {', '.join(sorted(unknown))}")


def parquet_values(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> list[dict[str, Any]]:
    """`rows` as the schema's columns take them: each checked (`check_row`), the JSON columns as text."""
    json_columns = [name for name in JSON_COLUMNS if schema.get_field_index(name) >= 0]
    out = []
    for row in rows:
        check_row(row, schema)
        out.append({**row, **{name: json.dumps(row[name]) for name in json_columns if name in row}})
    return out

"""`tokentape export`: a running gateway's sessions streamed to a dataset file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tokentape.cli.options import DatasetFormat, TrainerKey, trainer_headers
from tokentape.cli.root import app


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="Dataset file (.parquet or .jsonl).")],
    url: Annotated[str, typer.Option(help="The gateway to export from.")] = "http://127.0.0.1:8000",
    format: DatasetFormat = "tokentape",
    group_id: Annotated[str | None, typer.Option(help="Only this group.")] = None,
    finished: Annotated[bool | None, typer.Option("--finished/--unfinished", help="Only (un)finished sessions.")] = (
        None
    ),
    since: Annotated[float | None, typer.Option(help="Only sessions created at or after this Unix time.")] = None,
    prefix: Annotated[str | None, typer.Option(help="Only sessions whose id starts with this.")] = None,
    side_calls: Annotated[
        str,
        typer.Option(help="A harness's side calls (titles, summaries, subagents): false (left out), true, only."),
    ] = "false",
    api_key: TrainerKey = None,
    max_lag: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Leave out (or mask, see --lag-mode) tokens sampled more than this many weights versions "
            "before the gateway's current one.",
        ),
    ] = None,
    lag_mode: Annotated[
        str | None,
        typer.Option(help="With --max-lag: drop (the sample; default) or mask (its too-old tokens out of the loss)."),
    ] = None,
) -> None:
    """Export recorded sessions from a running gateway as a dataset file, streamed to disk as the
    gateway reads its store (the dataset is never held in memory)."""
    import httpx

    from tokentape.core.formats import check_format
    from tokentape.store.datasets import DATASET_SUFFIXES

    fmt = check_format(format)
    if out.suffix not in DATASET_SUFFIXES:
        typer.echo(f"export failed: a dataset file ends in {' or '.join(DATASET_SUFFIXES)}", err=True)
        raise typer.Exit(code=1)
    params = {
        "format": fmt,
        "output": out.suffix.removeprefix("."),
        "group_id": group_id,
        "since": since,
        "finished": None if finished is None else str(finished).lower(),
        "max_lag": max_lag,
        "lag_mode": lag_mode,
        "prefix": prefix,
        "side_calls": side_calls,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # a failed export never leaves a truncated dataset
    query = {k: v for k, v in params.items() if v is not None}
    headers = trainer_headers(api_key)
    with httpx.stream("GET", f"{url}/export", params=query, headers=headers, timeout=None) as response:
        if response.status_code != 200:
            typer.echo(f"export failed: {response.read().decode(errors='replace')}", err=True)
            raise typer.Exit(code=1)
        with partial.open("wb") as sink:
            for chunk in response.iter_bytes():
                sink.write(chunk)
    failure = trailer_error(partial)
    if failure is not None:  # the gateway failed after the first byte and said so at the end
        partial.unlink()
        typer.echo(f"export failed: {failure}", err=True)
        raise typer.Exit(code=1)
    partial.replace(out)
    if out.suffix == ".jsonl":
        with out.open("rb") as lines:
            count = sum(1 for line in lines if line.strip())
    else:
        import pyarrow.parquet as pq

        count = pq.read_metadata(out).num_rows
    typer.echo(f"{out}: {count} {fmt} rows")


def trailer_error(path: Path) -> str | None:
    """The error an export body ends with (`store.export.encode_dataset`: a last line `{"error": ...}`
    after rows or Parquet bytes), or None for a whole dataset file."""
    with path.open("rb") as file:
        file.seek(0, 2)
        size = file.tell()
        file.seek(max(0, size - 65536))
        tail = file.read()
    if path.suffix == ".parquet" and tail.endswith(b"PAR1"):
        return None
    last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        ended = json.loads(last)
    except ValueError:
        ended = None
    if isinstance(ended, dict) and set(ended) == {"error"} and isinstance(ended["error"], dict):
        return str(ended["error"].get("message"))
    if path.suffix == ".parquet" and size:
        return "the gateway's Parquet file ends without its footer"
    return None

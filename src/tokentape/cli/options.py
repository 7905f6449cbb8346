"""Options more than one verb takes, defined once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["DatasetFile", "DatasetFormat", "TrainerKey", "trainer_headers"]

TrainerKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="TOKENTAPE_API_KEY",
        help="A trainer key of the gateway, if it has keys (for creating, rewarding and exporting sessions; "
        "an agent gets only its own session's key).",
    ),
]
DatasetFormat = Annotated[str, typer.Option(help="Dataset format: tokentape, openrlhf, atropos, verifiers, stepwise.")]
DatasetFile = Annotated[Path, typer.Option(help="Dataset file (.parquet or .jsonl).")]


def trainer_headers(api_key: str | None) -> dict[str, str]:
    """What a trainer's own call carries on a gateway with keys (none: open mode)."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}

"""`tokentape doctor`: a chat template audited against the hard cases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokentape.cli.root import app


@app.command()
def doctor(
    model: Annotated[
        Path | None,
        typer.Argument(help="A Hugging Face model directory or a GGUF file. Default: the embedded model."),
    ] = None,
) -> None:
    """Audit a model's chat template against the hard cases: what is exact, what is bridged, what a
    rewrite will do."""
    from rich.console import Console
    from rich.table import Table

    from tokentape.render.doctor import audit
    from tokentape.runtime import embedded_model_path, gguf_renderer, hf_renderer

    target = model or embedded_model_path()
    renderer = hf_renderer(target) if target.is_dir() else gguf_renderer(target)
    table = Table(title=f"tokentape doctor: {target.name}", show_lines=True)
    for column in ("case", "verdict", "what happens"):
        table.add_column(column, overflow="fold")
    colours = {"exact": "green", "bridged": "cyan", "rewrite": "yellow", "note": "white", "problem": "red"}
    findings = audit(renderer)
    for finding in findings:
        table.add_row(finding.case, f"[{colours[finding.verdict]}]{finding.verdict}[/]", finding.detail)
    Console(width=140).print(table)
    if any(f.verdict == "problem" for f in findings):
        raise typer.Exit(code=1)

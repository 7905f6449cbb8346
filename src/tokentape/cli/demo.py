"""`tokentape demo`: the gateway on the embedded model and the bundled agent through it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokentape.cli.root import app


@app.command()
def demo(
    episodes: Annotated[int, typer.Option(min=4, help="Episodes to run (at least 4: one of each kind).")] = 4,
    out: Annotated[Path, typer.Option(help="Folder for the exported sessions.")] = Path("runs/demo"),
    port: Annotated[int, typer.Option(help="Port for the gateway; 0 picks a free one.")] = 0,
) -> None:
    """Start the gateway on the embedded model, run the bundled agent through it, export the tapes."""
    from tokentape.demo import run_demo

    run_demo(episodes=episodes, out=out, port=port)

"""The `tokentape` command: the typer app every verb module registers on, `--version`, and `main`."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["app", "main"]

app = typer.Typer(
    help="tokentape: an OpenAI-compatible gateway that records every sampled token for RL training.",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from tokentape.version import VERSION

        typer.echo(f"tokentape {VERSION}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """tokentape: an OpenAI-compatible gateway that records every sampled token for RL training."""


def main() -> None:
    app()

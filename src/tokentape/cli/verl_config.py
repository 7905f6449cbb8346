"""`tokentape verl-config`: where the YAML that registers verl's `tokentape_agent` loop lies."""

from __future__ import annotations

import typer

from tokentape.cli.root import app


@app.command("verl-config")
def verl_config() -> None:
    """Print the path of the YAML that registers verl's `tokentape_agent` loop (`agent_loop_config_path`)."""
    from importlib.resources import files

    typer.echo(str(files("tokentape.integrations") / "verl_agent_loop.yaml"))

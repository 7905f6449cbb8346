"""`tokentape status`: the Ray cluster `tokentape serve --ray` started."""

from __future__ import annotations

from typing import Annotated

import typer

from tokentape.cli.root import app


@app.command()
def status(
    address: Annotated[
        str, typer.Option(help="The Ray cluster to look at (as given to `ray start` / serve --ray).")
    ] = ("auto"),
) -> None:
    """The cluster started by `tokentape serve --ray`: gateways, engines, sessions, load, queues."""
    from rich.console import Console
    from rich.table import Table

    from tokentape.ray.cluster import cluster_status, connect

    connect(address)
    state = cluster_status()
    console = Console()
    gateways = Table(
        "gateway", "url", "node", "open sessions", "in memory", "requests active", "engine calls", "weights version"
    )
    for g in state["gateways"]:
        gateways.add_row(
            str(g["index"]),
            g["url"],
            g["node"][:12],
            str(g["open_sessions"]),
            str(g["sessions_in_memory"]),
            str(g["requests_active"]),
            str(g["engine_calls"]),
            str(g["weights_version"]),
        )
    console.print(gateways)
    engines = Table("engine", "in flight", "sessions", "weights version")
    # the version each engine actor holds (the registry updates them); a remote engine's is its gateways'
    versions = state["engines"].get("engine_versions", {})
    for name, flying in sorted(state["engines"]["in_flight"].items()):
        actor = name.removeprefix("ray://")
        version = versions.get(actor, 0) if actor != name else "-"
        engines.add_row(name, str(flying), str(state["engines"]["sessions"].get(name, 0)), str(version))
    console.print(engines)
    if state["queues"]:
        queues = Table("trajectory queue", "waiting", "capacity", "taken")
        for name, size in sorted(state["queues"].items()):
            queues.add_row(name, str(size["waiting"]), str(size["capacity"]), str(size["taken"]))
        console.print(queues)

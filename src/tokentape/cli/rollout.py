"""`tokentape rollout`: an agent run N times through the gateway, written as a dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokentape.cli.options import DatasetFile, DatasetFormat, TrainerKey
from tokentape.cli.root import app


@app.command()
def rollout(
    agent: Annotated[
        str,
        typer.Argument(
            help="An example name (arithmetic, calculator: examples/NAME_agent.py), "
            "path/to/file.py:func or package.module:func."
        ),
    ],
    episodes: Annotated[int, typer.Option(min=1, help="Episodes to run.")] = 16,
    concurrency: Annotated[int, typer.Option(min=1, help="Episodes in flight at once.")] = 4,
    group_size: Annotated[int, typer.Option(min=1, help="Episodes per group (same task; GRPO groups).")] = 4,
    url: Annotated[
        str | None, typer.Option(help="A running gateway (tokentape serve). Default: one in this process.")
    ] = None,
    api_key: TrainerKey = None,
    format: DatasetFormat = "tokentape",
    out: DatasetFile = Path("runs/rollout.parquet"),
) -> None:
    """Run an async agent N times through the gateway and write the episodes as a dataset."""
    import asyncio

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tokentape.client import GatewayClient, InProcessGateway
    from tokentape.core.formats import check_format
    from tokentape.rollout import RolloutStats, load_agent, run_rollout
    from tokentape.store.datasets import write_dataset

    fmt = check_format(format)
    run = load_agent(agent)
    console = Console()

    async def go() -> tuple[RolloutStats, int]:
        gateway = await GatewayClient.connect(url, api_key=api_key) if url else InProcessGateway()
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "turns {task.fields[turns]}  {task.fields[tps]:.0f} tok/s  errors {task.fields[errors]}"
                "  mean reward {task.fields[reward]}"
            ),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("episodes", total=episodes, turns=0, tps=0.0, errors=0, reward="-")

            def show(stats: RolloutStats) -> None:
                mean = stats.mean_reward
                progress.update(
                    task,
                    completed=stats.done,
                    turns=stats.turns,
                    tps=stats.tokens_per_second,
                    errors=stats.errors,
                    reward="-" if mean is None else f"{mean:.3f}",
                )

            stats = await run_rollout(
                run, gateway, episodes=episodes, concurrency=concurrency, group_size=group_size, on_progress=show
            )
        rows = (await gateway.export_all(format=fmt, prefix=f"{stats.run_id}-"))["data"]
        write_dataset(rows, out, fmt)
        await gateway.aclose()
        return stats, len(rows)

    stats, count = asyncio.run(go())
    mean = stats.mean_reward
    console.print(
        f"{stats.done} episodes ({stats.errors} errors, {stats.context_full} ended with a full context), "
        f"{stats.turns} turns, {stats.sampled_tokens} "
        f"sampled tokens, mean reward {'-' if mean is None else f'{mean:.3f}'}"
    )
    console.print(f"dataset: {out} ({count} {fmt} rows, run {stats.run_id})")
    for message in stats.error_messages[:5]:
        console.print(f"[red]{message}[/]")

"""`tokentape train`: the reference RL loop on the embedded model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokentape.cli.root import app


@app.command()
def train(
    agent: Annotated[
        str,
        typer.Argument(help="The agent: an example name (arithmetic), path/to/file.py:func or package.module:func."),
    ] = "arithmetic",
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps (one batch of rollouts each).")] = 20,
    groups: Annotated[int, typer.Option(min=1, help="Tasks per step.")] = 4,
    group_size: Annotated[int, typer.Option(min=2, help="Episodes per task (GRPO group).")] = 4,
    learning_rate: Annotated[float, typer.Option(help="AdamW learning rate of the LoRA.")] = 1e-3,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank.")] = 8,
    clip: Annotated[float, typer.Option(help="Truncated importance weight: min(p_trainer / p_engine, clip).")] = 2.0,
    temperature: Annotated[
        float, typer.Option(help="The agent's sampling temperature (logprobs are scaled by it).")
    ] = 0.8,
    weights: Annotated[
        str, typer.Option(help="What the engine serves: f32 (a dequantized copy) or q4_1 (as shipped).")
    ] = ("f32"),
    seed: Annotated[int, typer.Option(help="Seeds the LoRA, torch and the tasks.")] = 0,
    eval_every: Annotated[
        int,
        typer.Option(min=0, help="Greedy evaluation on the agent's held-out tasks every this many updates (0: none)."),
    ] = 5,
    out: Annotated[Path, typer.Option(help="steps.jsonl, train.png and the adapters go here.")] = Path("runs/train"),
    url: Annotated[
        str | None,
        typer.Option(
            help="A gateway you run (tokentape serve, in front of the embedded model's F32 copy, vLLM or Ray) "
            "instead of one in this process; it must read the adapters written under --out."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="TOKENTAPE_API_KEY",
            help="A trainer key of the gateway at --url: sessions, rewards, exports and weight updates carry it.",
        ),
    ] = None,
    packed: Annotated[
        bool,
        typer.Option(
            help="Forward each group as one packed row (every shared token once, a 4D attention mask) instead "
            "of one row per branch: the same loss, fewer tokens."
        ),
    ] = False,
) -> None:
    """The reference RL loop: GRPO on a LoRA of the embedded model, learning from the tape, pushing each
    update to the engine (POST /admin/weights)."""
    import asyncio

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tokentape.rollout import load_agent
    from tokentape.train.loop import EvalRecord, StepRecord, TrainConfig
    from tokentape.train.loop import train as run_training
    from tokentape.train.plot import plot_steps

    if weights not in ("f32", "q4_1"):
        raise typer.BadParameter("weights: f32 or q4_1")
    config = TrainConfig(
        steps=steps,
        groups=groups,
        group_size=group_size,
        learning_rate=learning_rate,
        rank=rank,
        clip=clip,
        temperature=temperature,
        weights="f32" if weights == "f32" else "q4_1",
        seed=seed,
        out=out,
        url=url,
        api_key=api_key,
        eval_every=eval_every,
        packed=packed,
    )
    console = Console()
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("steps", total=steps, reward="-")

        def show(record: StepRecord) -> None:
            m, t = record.metrics, record.seconds
            progress.console.print(
                f"step {record.step:3d} v{record.version}  reward {record.reward_mean:.3f}  "
                f"|dlogp| mean {m['logprob_diff_mean']:.2e} max {m['logprob_diff_max']:.2e}  "
                f"k3 {m['kl_k3']:.2e}  ratio {m['ratio_min']:.3f}/{m['ratio_mean']:.3f}/{m['ratio_max']:.3f}  "
                f"clipped {m['clipped_share']:.1%}  "
                f"({t['rollout']:.1f}s rollout, {t['forward_backward']:.1f}s fwd/bwd, {t['push']:.2f}s push)"
            )
            progress.update(task, advance=1, reward=f"{record.reward_mean:.3f}")

        evaluations: list[EvalRecord] = []

        def evaluated(record: EvalRecord) -> None:
            evaluations.append(record)
            progress.console.print(
                f"held-out after {record.updates} updates: reward {record.reward_mean:.3f} "
                f"({len(record.rewards)} tasks, greedy{f', {record.errors} errors' if record.errors else ''})"
            )

        records = asyncio.run(run_training(config, load_agent(agent), on_step=show, on_eval=evaluated))
    png = plot_steps(out / "steps.jsonl", out / "train.png", title=f"tokentape train {agent} ({weights}, seed {seed})")
    first = [r.reward_mean for r in records[:5]]
    last = [r.reward_mean for r in records[-5:]]
    console.print(
        f"mean reward: first {len(first)} steps {sum(first) / len(first):.3f}, last {len(last)} steps "
        f"{sum(last) / len(last):.3f}; steps: {out / 'steps.jsonl'}, plot: {png}"
    )
    if evaluations:
        console.print(
            f"held-out reward (greedy): base {evaluations[0].reward_mean:.3f}, "
            f"final {evaluations[-1].reward_mean:.3f} ({out / 'heldout.jsonl'})"
        )

"""The loop's figures as PNGs.

- `plot_steps`: one run: training reward per step and held-out reward (greedy) at each evaluation
  above, engine/trainer mismatch per step below.
- `plot_seeds`: several runs (seeds) side by side on one axis: training reward (thin) and held-out
  reward (thick), one colour per seed. `python -m tokentape.train.plot RUN_DIR... --out PNG`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["plot_seeds", "plot_steps", "read_run"]


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_run(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the step records, the held-out evaluations) a run wrote to `out`."""
    return _lines(out / "steps.jsonl"), _lines(out / "heldout.jsonl")


def plot_steps(jsonl: Path, png: Path, title: str = "tokentape train") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, held = read_run(jsonl.parent)
    steps = [r["step"] for r in records]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [r["reward_mean"] for r in records], marker="o", label="training reward (sampled, T as trained)")
    if held:
        top.plot(
            [e["updates"] for e in held],
            [e["reward_mean"] for e in held],
            marker="s",
            linewidth=2,
            label=f"held-out reward (greedy, {len(held[0]['rewards'])} fixed tasks)",
        )
    top.set_ylabel("mean reward")
    top.set_title(title)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    for key, label in (
        ("logprob_diff_mean", "mean |engine - trainer| logprob"),
        ("logprob_diff_max", "max |engine - trainer| logprob"),
        ("kl_k3", "KL(engine || trainer), k3"),
    ):
        bottom.plot(steps, [max(r["metrics"][key], 1e-12) for r in records], marker=".", label=label)
    bottom.set_yscale("log")
    bottom.set_xlabel("policy version (updates applied)")
    bottom.set_ylabel("nats")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return png


def plot_seeds(runs: list[Path], png: Path, title: str = "tokentape train arithmetic: seeds") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for index, run in enumerate(runs):
        records, held = read_run(run)
        colour = f"C{index}"
        axis.plot(
            [r["step"] for r in records],
            [r["reward_mean"] for r in records],
            color=colour,
            alpha=0.45,
            linewidth=1,
            label=f"{run.name}: training",
        )
        if held:
            axis.plot(
                [e["updates"] for e in held],
                [e["reward_mean"] for e in held],
                color=colour,
                marker="s",
                linewidth=2.2,
                label=f"{run.name}: held-out (greedy)",
            )
    axis.set_xlabel("policy version (updates applied)")
    axis.set_ylabel("mean reward")
    axis.set_title(title)
    axis.legend(fontsize=7, ncol=2)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return png


def main(arguments: list[str]) -> None:
    if "--out" not in arguments or arguments.index("--out") + 1 >= len(arguments):
        raise SystemExit("usage: python -m tokentape.train.plot RUN_DIR... --out PNG")
    at = arguments.index("--out")
    png = Path(arguments[at + 1])
    runs = [Path(a) for a in arguments[:at] + arguments[at + 2 :]]
    print(plot_seeds(runs, png))
    for run in runs:
        _, held = read_run(run)
        if held:
            print(
                f"{run}: held-out reward {held[0]['reward_mean']:.3f} (base) -> {held[-1]['reward_mean']:.3f} (final)"
            )


if __name__ == "__main__":
    main(sys.argv[1:])

"""The loop's figures as a PNG: reward per step above, engine/trainer mismatch per step below."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot_steps"]


def plot_steps(jsonl: Path, png: Path, title: str = "tokentape train") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [r["reward_mean"] for r in records], marker="o")
    top.set_ylabel("mean reward")
    top.set_title(title)
    top.grid(alpha=0.3)
    for key, label in (
        ("logprob_diff_mean", "mean |engine - trainer| logprob"),
        ("logprob_diff_max", "max |engine - trainer| logprob"),
        ("kl_k3", "KL(engine || trainer), k3"),
    ):
        bottom.plot(steps, [max(r["metrics"][key], 1e-12) for r in records], marker=".", label=label)
    bottom.set_yscale("log")
    bottom.set_xlabel("step (policy version that sampled it)")
    bottom.set_ylabel("nats")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return png

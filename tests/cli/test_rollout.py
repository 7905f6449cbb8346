"""`tokentape rollout` on the bundled examples writes a dataset pyarrow can load; a failing agent is
recorded as an error, not a crash."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from tokentape.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_rollout_of_the_arithmetic_example_writes_a_grouped_dataset(tmp_path: Path) -> None:
    out = tmp_path / "arith.parquet"
    result = CliRunner().invoke(
        app,
        [
            "rollout",
            str(EXAMPLES / "arithmetic_agent.py") + ":agent",
            "--episodes",
            "4",
            "--group-size",
            "2",
            "--concurrency",
            "2",
            "--format",
            "verifiers",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.num_rows == 4
    rows = table.to_pylist()
    assert len({r["group_id"] for r in rows}) == 2
    for row in rows:
        assert row["reward"] is not None and 0.0 <= row["reward"] <= 1.0
        assert sum(row["completion_mask"]) > 0 and len(row["completion_mask"]) == len(row["completion_ids"])
        assert row["finished"] is True
    assert table.schema.metadata[b"tokentape.format"] == b"verifiers"


def test_rollout_of_the_tool_example_and_a_broken_agent(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text(
        "async def agent(client, episode):\n"
        "    await client.chat.completions.create(model=episode.model, messages=[{'role': 'user', 'content': 'x'}],"
        " max_tokens=2)\n"
        "    raise RuntimeError('the environment crashed')\n"
    )
    out = tmp_path / "broken.jsonl"
    result = CliRunner().invoke(app, ["rollout", f"{broken}:agent", "--episodes", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 errors" in result.output
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and "the environment crashed" in lines[0]
    calc = tmp_path / "calc.parquet"
    result = CliRunner().invoke(
        app,
        [
            "rollout",
            str(EXAMPLES / "calculator_agent.py") + ":agent",
            "--episodes",
            "2",
            "--group-size",
            "2",
            "--out",
            str(calc),
        ],
    )
    assert result.exit_code == 0, result.output
    assert pq.read_table(calc).num_rows == 2

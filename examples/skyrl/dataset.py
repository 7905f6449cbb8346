"""A GSM8K-style dataset in SkyRL's format (the columns SkyRL's `examples/gsm8k/gsm8k_dataset.py`
writes, read by its `PromptDataset`): sums of two numbers, the answer as `reward_spec.ground_truth`.

    python examples/skyrl/dataset.py [OUT_DIR]     # writes train.parquet (512 rows) and validation.parquet (64)

`prompt` is the chat messages; `env_class` names SkyRL-Gym's environment, which tokentape's generator
does not make (the agent replaces it); every other column reaches the agent in `row["env_extras"]`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        out.append(
            {
                "data_source": "arithmetic",
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? End your answer with 'Answer: N'."}],
                "env_class": "tokentape",
                "reward_spec": {"method": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i},
            }
        )
    return out


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows(512, 0, "train")), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows(64, 1, "validation")), out / "validation.parquet")
    print(pq.read_table(out / "train.parquet").num_rows, "training rows in", out)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("."))

"""`examples/verl/`: the dataset is in the columns verl's RLHFDataset reads, and the agent scores a
reply against the row's ground truth (a scripted engine answers, right once and wrong once)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pyarrow.parquet as pq

from tests.conftest import MODEL_NAME
from tokentape.client import InProcessGateway
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.served import ServeSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verl"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"verl_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dataset_has_verls_columns_and_true_answers(tmp_path: Path) -> None:
    _load("dataset").main(tmp_path)
    train, test = (
        pq.read_table(tmp_path / "train.parquet").to_pylist(),
        pq.read_table(tmp_path / "test.parquet").to_pylist(),
    )
    assert (len(train), len(test)) == (512, 64)
    row = train[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    a, b = (int(n) for n in row["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + "))
    assert row["reward_model"]["ground_truth"] == str(a + b)


async def test_the_agent_scores_against_the_ground_truth(renderer: Renderer) -> None:
    solve = _load("agents").solve
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = ScriptedEngine([], end)
    gateway = InProcessGateway(ServeSpec(served_model_name=MODEL_NAME), engine=engine, renderer=renderer)
    row = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "reward_model": {"ground_truth": "5"}}
    try:
        rewards = []
        for n, answer in enumerate(("Answer: 5", "Answer: 4")):
            engine.push([*renderer.tokenizer.encode(answer), end])
            await gateway.create_session(f"try-{n}")
            rewards.append(await solve(gateway.client(f"try-{n}"), row["prompt"], row))
    finally:
        await gateway.aclose()
    assert rewards == [1.0, 0.0]

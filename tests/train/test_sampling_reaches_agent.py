"""`tokentape train --temperature` reaches the agent: the settings the trainer computes its logprobs
under go to every call the example agent makes (`Episode.sampling`), and each turn records what it
was sampled with, which the export shows and the loop checks."""

from __future__ import annotations

from pathlib import Path

from tokentape.client import InProcessGateway
from tokentape.rollout import load_agent, run_rollout
from tokentape.served import Served


async def test_the_trainers_sampling_settings_reach_every_turn_of_the_example_agent(built: Served) -> None:
    local = InProcessGateway(served=built)
    agent = load_agent("arithmetic", Path(__file__).parents[2] / "examples")
    sampling = {"temperature": 0.35, "top_p": 1.0}
    stats = await run_rollout(agent, local, episodes=1, concurrency=1, group_size=1, run_id="temp", sampling=sampling)
    assert stats.errors == 0, stats.error_messages
    (branch, *_) = (await local.export("temp-00000"))["branches"]
    recorded = [s for s, (start, end) in zip(branch["sampling"], branch["action_ranges"], strict=True) if end > start]
    assert recorded and recorded == [{**sampling, "top_k": 0, "min_p": 0.0}] * len(recorded)

"""The agent for `dataset.py`'s rows, as SkyRL's generator runs it (`tokentape.agent=examples/skyrl/agents.py:solve`,
or your own package's `module:function`): it takes SkyRL's row as its third parameter and scores
itself against `env_extras["reward_spec"]["ground_truth"]`. SkyRL takes its rewards from the
generator, so the return value is the reward.

    python examples/skyrl/agents.py     # one row on the embedded model, in this process (CPU)
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import openai


async def solve(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]], row: dict[str, Any]) -> float:
    model = (await client.models.list()).data[0].id
    reply = await client.chat.completions.create(model=model, messages=prompt, max_tokens=48)  # type: ignore[arg-type]
    numbers = re.findall(r"-?\d+", reply.choices[0].message.content or "")
    return 1.0 if numbers and numbers[-1] == row["env_extras"]["reward_spec"]["ground_truth"] else 0.0


async def main() -> None:
    from tokentape.client import InProcessGateway

    gateway = InProcessGateway()  # the embedded model, in this process
    await gateway.create_session("try-1")
    prompt = [{"role": "user", "content": "What is 2 + 3? End with 'Answer: N'."}]
    row = {"env_class": "tokentape", "env_extras": {"reward_spec": {"ground_truth": "5"}}, "trajectory_id": "0_0"}
    print("reward:", await solve(gateway.client("try-1"), prompt, row))  # a 135M model: usually 0
    await gateway.aclose()


if __name__ == "__main__":
    asyncio.run(main())

"""What tokentape's verl agent loop adds per call and per episode, beside verl's own loop, on a
scripted instant server manager (it answers 32 fixed tokens at once: the figures are the loops' own
work, not inference).

- tokentape: `TokentapeAgentLoop.run` with an agent of `--turns` calls (each sends the history so far
  plus a new user message). Per call: the time the agent waits for `chat.completions.create` minus
  the time spent inside `server_manager.generate`; per episode: `run`'s wall time minus the agent's
  calls (session create, finish, export, the output).
- verl: `SingleTurnAgentLoop.run` (verl 0.9.1, its Continuous Token builder) on the same server
  manager and prompt: its wall time minus the time inside `generate`, one call per episode.

    python benchmarks/verl_cost.py [--episodes 30] [--turns 4]

Wall time, medians over the episodes, on whatever else the machine is running (load average shown).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.models import gguf_tokenizer_dir

from tokentape.runtime import embedded_model_path

REPLY = "The answer is forty-two, and here is a little more text to fill the turn out to size."
WAITS: list[float] = []  # seconds each agent call waited, tokentape side


class InstantServers:
    """verl's server manager, answering a fixed reply (ending in the turn's end) at once."""

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
        self.inside: list[float] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        started = time.perf_counter()
        tokens = self.reply[: sampling_params.get("max_tokens") or len(self.reply)]
        output = TokenOutput(
            token_ids=tokens, log_probs=[-0.1] * len(tokens), stop_reason="completed", extra_fields={"global_steps": 0}
        )
        self.inside.append(time.perf_counter() - started)
        return output


async def agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]]) -> float:
    messages = list(prompt)
    model = (await client.models.list()).data[0].id
    for _ in range(int(os.environ["VERL_COST_TURNS"])):
        started = time.perf_counter()
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=64)
        WAITS.append(time.perf_counter() - started)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
        messages += [{"role": "user", "content": "Go on."}]
    return 1.0


def _config(model_dir: Path) -> Any:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"prompt_length": 1024, "response_length": 2048, "multi_turn": {"tool_config_path": None}},
                "model": {"path": str(model_dir)},
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )


async def main(episodes: int, turns: int) -> None:
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer import hf_tokenizer

    from tokentape.integrations.verl import TokentapeAgentLoop

    os.environ["VERL_COST_TURNS"] = str(turns)
    model_dir = gguf_tokenizer_dir(embedded_model_path(), Path(tempfile.mkdtemp()))
    tokenizer = hf_tokenizer(str(model_dir))
    reply = [*tokenizer.encode(REPLY, add_special_tokens=False)[:31], tokenizer.convert_tokens_to_ids("<|im_end|>")]
    config = _config(model_dir)
    parts = {
        "trainer_config": DictConfigWrap(config),
        "tokenizer": tokenizer,
        "processor": None,
        "dataset_cls": RLHFDataset,
        "data_config": DictConfigWrap(config.data),
    }
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    prompt = [{"role": "user", "content": "What is six times seven? Explain briefly."}]

    ours = InstantServers(reply)
    tape_episode, tape_rest = [], []
    for _ in range(episodes + 1):  # the first builds the worker's gateway: not counted
        loop = TokentapeAgentLoop(server_manager=ours, agent=agent, **parts)
        WAITS.clear()
        inside_before = len(ours.inside)
        started = time.perf_counter()
        result = await loop.run(params, raw_prompt=prompt)
        assert result.extra_fields["tokentape_status"] == "done", result.extra_fields["tokentape_error"]
        wall = time.perf_counter() - started
        inside = ours.inside[inside_before:]
        tape_episode.append((wall, list(WAITS), inside))
    tape_episode = tape_episode[1:]
    per_call = [w - i for _, waits, inside in tape_episode for w, i in zip(waits, inside, strict=True)]
    tape_rest = [wall - sum(waits) for wall, waits, _ in tape_episode]

    theirs = InstantServers(reply)
    verl_episode = []
    for _ in range(episodes + 1):
        loop = SingleTurnAgentLoop(server_manager=theirs, **parts)
        before = len(theirs.inside)
        started = time.perf_counter()
        await loop.run(dict(params), raw_prompt=prompt)
        verl_episode.append(time.perf_counter() - started - sum(theirs.inside[before:]))
    verl_episode = verl_episode[1:]

    ms = 1000.0
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores; {episodes} episodes, medians")
    print(f"tokentape, per call (agent's wait minus time inside generate): {statistics.median(per_call) * ms:.2f} ms")
    print(f"tokentape, per episode outside its calls: {statistics.median(tape_rest) * ms:.2f} ms")
    print(f"tokentape, per {turns}-call episode in all: {statistics.median(w for w, _, _ in tape_episode) * ms:.2f} ms")
    print(
        f"verl SingleTurnAgentLoop, per one-call episode, minus generate: {statistics.median(verl_episode) * ms:.2f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main(args.episodes, args.turns))

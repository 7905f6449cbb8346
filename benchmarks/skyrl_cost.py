"""What tokentape's SkyRL generator adds per call and per trajectory, beside SkyRL's own generator, on
a scripted instant inference client (it answers 32 fixed tokens at once: the figures are the
generators' own work, not inference).

- tokentape: `TokentapeGenerator.generate` on one trajectory whose agent makes `--turns` calls (each
  sends the history so far plus a new user message). Per call: the time the agent waits for
  `chat.completions.create` minus the time inside the client's `generate`; per trajectory:
  `generate`'s wall time minus the agent's calls (session, export, the rows, the metrics).
- SkyRL: `SkyRLGymGenerator.generate` (skyrl 0.3.0) on one trajectory of its gsm8k environment (one
  call) on the same client and prompt: its wall time minus the time inside the client's `generate`.

    python benchmarks/skyrl_cost.py [--episodes 30] [--turns 4]

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.models import gguf_tokenizer_dir

from tokentape.integrations.skyrl import TokentapeGenerator  # first: it makes skyrl importable on 3.11
from tokentape.runtime import embedded_model_path

REPLY = "The answer is forty-two, and here is a little more text to fill the turn out to size."
WAITS: list[float] = []  # seconds each agent call waited, tokentape side
TURNS = 4


class InstantClient:
    """SkyRL's inference client, answering a fixed reply (ending in the turn's end) at once."""

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
        self.inside: list[float] = []
        self.weight_version = 0

    async def generate(self, input_batch: Any, model: str | None = None) -> Any:
        started = time.perf_counter()
        limit = input_batch["sampling_params"].get("max_tokens") or len(self.reply)
        tokens = self.reply[:limit]
        output = {
            "responses": [REPLY],
            "response_ids": [tokens],
            "stop_reasons": ["stop"],
            "response_logprobs": [[-0.1] * len(tokens)],
        }
        self.inside.append(time.perf_counter() - started)
        return output

    async def finish_session(self, session_id: str) -> None:
        return None


async def agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]]) -> float:
    messages = list(prompt)
    model = (await client.models.list()).data[0].id
    for _ in range(TURNS):
        started = time.perf_counter()
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=64)
        WAITS.append(time.perf_counter() - started)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
        messages += [{"role": "user", "content": "Go on."}]
    return 1.0


async def main(episodes: int) -> None:
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from skyrl.train.generators.utils import prepare_generator_input
    from skyrl.utils.tok import get_tokenizer

    model_dir = gguf_tokenizer_dir(embedded_model_path(), Path(tempfile.mkdtemp()))
    tokenizer = get_tokenizer(str(model_dir), padding_side="left")
    reply = [*tokenizer.encode(REPLY, add_special_tokens=False)[:31], tokenizer.convert_tokens_to_ids("<|im_end|>")]
    cfg = SkyRLTrainConfig.from_cli_overrides({"generator.max_input_length": 2048, "generator.max_turns": 1})
    row = {
        "prompt": [{"role": "user", "content": "What is six times seven? Explain briefly."}],
        "env_class": "gsm8k",
        "env_extras": {"reward_spec": {"method": "rule", "ground_truth": "42"}},
        "uid": "0",
    }
    sampling = get_sampling_params_for_backend("vllm", cfg.generator.sampling_params)

    def batch() -> Any:
        return prepare_generator_input([row], 1, sampling, "gsm8k", "train", 1)[0]

    ours = InstantClient(reply)
    generator = TokentapeGenerator(cfg.generator, tokenizer, ours, agent=agent, tokenizer_dir=str(model_dir))
    tape = []
    for _ in range(episodes + 1):  # the first builds the gateway: not counted
        WAITS.clear()
        before = len(ours.inside)
        started = time.perf_counter()
        out = await generator.generate(batch())
        assert out["tokentape_status"] == ["done"], out  # type: ignore[typeddict-item]
        tape.append((time.perf_counter() - started, list(WAITS), ours.inside[before:]))
    tape = tape[1:]
    per_call = [w - i for _, waits, inside in tape for w, i in zip(waits, inside, strict=True)]
    rest = [wall - sum(waits) for wall, waits, _ in tape]

    theirs = InstantClient(reply)
    gym = SkyRLGymGenerator(cfg.generator, cfg.environment.skyrl_gym, theirs, tokenizer)
    skyrl = []
    for _ in range(episodes + 1):
        before = len(theirs.inside)
        started = time.perf_counter()
        await gym.generate(batch(), disable_tqdm=True)
        skyrl.append(time.perf_counter() - started - sum(theirs.inside[before:]))
    skyrl = skyrl[1:]

    ms = 1000.0
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores; {episodes} episodes, medians")
    print(f"tokentape, per call (agent's wait minus time inside generate): {statistics.median(per_call) * ms:.2f} ms")
    print(f"tokentape, per trajectory outside its calls: {statistics.median(rest) * ms:.2f} ms")
    print(f"tokentape, per {TURNS}-call trajectory in all: {statistics.median(w for w, _, _ in tape) * ms:.2f} ms")
    print(f"SkyRLGymGenerator, per one-call gsm8k trajectory, minus generate: {statistics.median(skyrl) * ms:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--turns", type=int, default=TURNS)
    args = parser.parse_args()
    TURNS = args.turns
    asyncio.run(main(args.episodes))

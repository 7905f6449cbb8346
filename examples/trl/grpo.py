"""GRPO with TRL's GRPOTrainer, every rollout through tokentape: a complete program, on this CPU.

    python examples/trl/grpo.py                                   # 10 steps, groups of 4 (a few minutes)
    python examples/trl/grpo.py --steps 1 --group-size 2 --max-tokens 8 --out runs/trl-small

The agent, `solve`, is an ordinary program on the openai SDK: it asks one sum and rewards itself 1.0
when the last number of the reply is right. The gateway runs in this process on the embedded model
(SmolLM2-135M, an F32 copy, so that the engine samples what the trainer's model computes); TRL trains a
LoRA of the same weights from the tape (`rollout_func`, `tape_reward`), and `PushLora` sends it to the
engine after every step, so the next rollouts sample the new policy.

On GPU machines the agent, the dataset and `rollout_func` stay: `model` is your Hugging Face model and
`gateway` is `asyncio.run(GatewayClient.connect("http://gateway:8000", api_key=...))` for a
`tokentape serve` in front of vLLM. `PushLora` writes llama.cpp adapters, for the embedded engine; a
vLLM engine loads adapters in its own format (docs/guides/weights.md).
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import datasets
import openai
import peft
import transformers
import trl

from tokentape.client import InProcessGateway
from tokentape.integrations.trl import PushLora, rollout_func, tape_reward
from tokentape.runtime import embedded_model_path
from tokentape.served import ServeSpec
from tokentape.train.weights import LORA_TARGETS, f32_gguf, load_model

MAX_TOKENS = 24  # per reply; --max-tokens changes it


async def solve(client: openai.AsyncOpenAI, prompt: list[dict[str, str]]) -> float:
    """One question, one reply: 1.0 when the reply's last number is the sum asked for."""
    model = (await client.models.list()).data[0].id
    reply = await client.chat.completions.create(model=model, messages=prompt, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    a, b = (int(n) for n in re.findall(r"\d+", prompt[-1]["content"])[:2])
    numbers = re.findall(r"-?\d+", reply.choices[0].message.content or "")
    return 1.0 if numbers and int(numbers[-1]) == a + b else 0.0


def questions(n: int, seed: int = 0) -> datasets.Dataset:
    """`n` prompts in TRL's conversational format: one user message each."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        prompts.append([{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}])
    return datasets.Dataset.from_dict({"prompt": prompts})


def main() -> None:
    global MAX_TOKENS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt (GRPO's group)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--out", type=Path, default=Path("runs/trl"))
    args = parser.parse_args()
    MAX_TOKENS = args.max_tokens

    # the gateway, in this process, on an F32 copy of the embedded model
    f32 = f32_gguf(embedded_model_path())
    gateway = InProcessGateway(ServeSpec(model=f32, context_length=512))

    # the trainer: the same weights, as a transformers model, with a LoRA TRL trains
    model = load_model(f32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(f32.parent), gguf_file=f32.name)
    config = trl.GRPOConfig(
        output_dir=str(args.out),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=args.group_size,  # one group per step
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    trainer = trl.GRPOTrainer(
        model=model,
        args=config,
        train_dataset=questions(args.steps),
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=sorted(LORA_TARGETS)),
        reward_funcs=[tape_reward],  # the reward each agent returned
        rollout_func=rollout_func(solve, gateway),  # each prompt one session, cut TRL's way
        callbacks=[PushLora(gateway, args.out / "adapters")],  # the LoRA to the engine after each step
    )
    trainer.train()
    for entry in trainer.state.log_history:
        if "reward" in entry:
            print(f"step {entry['step']}: mean reward {entry['reward']:.3f}")


if __name__ == "__main__":
    main()

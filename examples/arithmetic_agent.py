"""A multi-turn arithmetic agent with a checkable reward, for `tokentape rollout arithmetic`.

Each group of episodes gets one task (three numbers); the agent asks for a sum, then asks to add a
third number to the answer it got. Reward: the fraction of the two answers that are right.
"""

from __future__ import annotations

import random
import re

import openai

from tokentape.rollout import Episode

NUMBER = re.compile(r"-?\d+")


def _first_number(text: str | None) -> int | None:
    match = NUMBER.search(text or "")
    return int(match.group()) if match else None


async def agent(client: openai.AsyncOpenAI, episode: Episode) -> float:
    rng = random.Random(episode.group)
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a calculator. Answer with a number only."},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]
    first = await client.chat.completions.create(
        model=episode.model, messages=messages, max_tokens=24, temperature=0.8, seed=episode.index
    )
    answer = first.choices[0].message.content or ""
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": f"Now add {c} to that. What is the result?"},
    ]
    second = await client.chat.completions.create(
        model=episode.model, messages=messages, max_tokens=24, temperature=0.8, seed=episode.index + 1000
    )
    correct = [_first_number(answer) == a + b, _first_number(second.choices[0].message.content) == a + b + c]
    return sum(correct) / len(correct)

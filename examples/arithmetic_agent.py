"""A multi-turn arithmetic agent with a checkable reward, for `tokentape rollout arithmetic`.

Each group of episodes gets one task (three numbers); the agent asks for a sum, then asks to add a
third number to the answer it got. Each answer scores 1.0 when it is the number alone, 0.5 when the
number is in it among other text, 0 otherwise; the reward is the mean of the two (a graded reward a
135M model can climb: it already says the number sometimes, rarely alone).
"""

from __future__ import annotations

import random
import re

import openai

from tokentape.rollout import Episode

NUMBER = re.compile(r"-?\d+")


def score(text: str | None, expected: int) -> float:
    """1.0: the number alone (spaces or a final full stop aside); 0.5: the number among other text."""
    reply = (text or "").strip().rstrip(".").strip()
    if reply == str(expected):
        return 1.0
    return 0.5 if str(expected) in NUMBER.findall(reply) else 0.0


async def agent(client: openai.AsyncOpenAI, episode: Episode) -> float:
    run = episode.session_id.rsplit("-", 1)[0]  # a new run (a training step) draws new tasks
    rng = random.Random(f"{run}:{episode.group}")
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
    return (score(answer, a + b) + score(second.choices[0].message.content, a + b + c)) / 2

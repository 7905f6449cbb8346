"""A multi-turn arithmetic agent with a checkable reward, for `tokentape rollout arithmetic`.

Each group of episodes gets one task (three numbers); the agent asks for a sum, then asks to add a
third number to the answer it got. Each answer scores 1.0 when it is the number alone; 0.5 when the
right number is the only number in it besides those of the question ("5 + 7 = 12", "The answer is
12."); 0 otherwise, so a reply that lists numbers to hit the right one among them earns nothing. The
reward is the mean of the two (a graded reward a 135M model can climb: it already says the number
sometimes, rarely alone).
"""

from __future__ import annotations

import random
import re

import openai

from tokentape.rollout import Episode

__all__ = ["agent", "held_out", "score", "task"]

NUMBER = re.compile(r"-?\d+")


def score(text: str | None, expected: int, given: tuple[int, ...] = ()) -> float:
    """1.0: the number alone (spaces or a final full stop aside); 0.5: the number among other text
    whose other numbers are all the question's own (`given`); 0 otherwise (any other number)."""
    reply = (text or "").strip().rstrip(".").strip()
    if reply == str(expected):
        return 1.0
    new = {int(n) for n in NUMBER.findall(reply)} - set(given)
    return 0.5 if new == {expected} else 0.0


def held_out(a: int, b: int, c: int) -> bool:
    """The tasks kept for evaluation (about one in eight): training never draws them."""
    return (a * 100 + b * 10 + c) % 8 == 0


def task(run: str, group: int) -> tuple[int, int, int]:
    """A run's group's three numbers: a held-out run (`heldout...`) draws from the held-out tasks, the
    same ones for every such run (a fixed set); any other run draws new tasks outside them."""
    evaluation = run.startswith("heldout")
    rng = random.Random(f"heldout:{group}" if evaluation else f"{run}:{group}")
    while True:
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        if held_out(a, b, c) == evaluation:
            return a, b, c


async def agent(client: openai.AsyncOpenAI, episode: Episode) -> float:
    run = episode.session_id.rsplit("-", 1)[0]  # a new run (a training step) draws new tasks
    a, b, c = task(run, episode.group)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a calculator. Answer with a number only."},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]
    sampling = {"temperature": 0.8, **episode.sampling}  # the trainer's settings, when one trains on it
    first = await client.chat.completions.create(
        model=episode.model, messages=messages, max_tokens=24, seed=episode.index, **sampling
    )
    answer = first.choices[0].message.content or ""
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": f"Now add {c} to that. What is the result?"},
    ]
    second = await client.chat.completions.create(
        model=episode.model, messages=messages, max_tokens=24, seed=episode.index + 1000, **sampling
    )
    second_score = score(second.choices[0].message.content, a + b + c, (a, b, a + b, c))
    return (score(answer, a + b, (a, b)) + second_score) / 2

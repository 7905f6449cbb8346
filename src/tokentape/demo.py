"""The bundled example: a small multi-turn agent written against the plain `openai` SDK, run through
a real gateway process on the embedded model, then exported. It shows each recording path: a plain
multi-turn episode, a turn cut by max_tokens, n=2 branching, and a streamed turn."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from rich.console import Console
from rich.table import Table

from tokentape.launcher import running_server
from tokentape.viewer import static_page

__all__ = ["run_demo", "EPISODE_KINDS"]

QUESTIONS = [
    "What is the capital of France?",
    "Name a fruit that is yellow.",
    "What is 3 + 4?",
    "Which planet is closest to the sun?",
    "What colour is the sky on a clear day?",
    "How many legs does a spider have?",
]
FOLLOW_UPS = ["Why is that?", "Say it in one short sentence.", "Thank you. Anything else to add?"]

Episode = Callable[[openai.AsyncOpenAI, str, str], Awaitable[int]]


async def plain_episode(client: openai.AsyncOpenAI, model: str, question: str) -> int:
    """Three turns; each reply is echoed back as the agent's history."""
    messages: list[Any] = [{"role": "user", "content": question}]
    for follow_up in FOLLOW_UPS[:2]:
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.7)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": follow_up}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.7)
    return 3


# An answer that cannot fit in 6 tokens: the first reply is cut by max_tokens whatever the CPU's rounding.
LONG_ANSWER = "Count from one to fifty in words, separated by commas."


async def truncated_episode(client: openai.AsyncOpenAI, model: str, question: str) -> int:
    """The first reply is cut by max_tokens; the gateway bridges its missing turn close. The question
    asks for more than 6 tokens; a sample that still ends early is drawn again (a sibling branch)."""
    for _ in range(8):
        messages: list[Any] = [{"role": "user", "content": f"{question} {LONG_ANSWER}"}]
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0.7)
        if reply.choices[0].finish_reason == "length":
            break
    else:
        raise RuntimeError("8 samples in a row ended within 6 tokens: the model does not follow the question")
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
    messages += [{"role": "user", "content": "Please finish your answer."}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.7)
    return 2


async def branching_episode(client: openai.AsyncOpenAI, model: str, question: str) -> int:
    """n=2 on the first turn makes two branches; the agent continues the first one."""
    messages: list[Any] = [{"role": "user", "content": question}]
    reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=32, n=2, temperature=1.0)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
    messages += [{"role": "user", "content": FOLLOW_UPS[0]}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.7)
    return 2


async def streaming_episode(client: openai.AsyncOpenAI, model: str, question: str) -> int:
    """The second turn is streamed; the agent rebuilds the reply from the deltas, as agents do."""
    messages: list[Any] = [{"role": "user", "content": question}]
    reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.7)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
    messages += [{"role": "user", "content": FOLLOW_UPS[1]}]
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0.7, stream=True
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UPS[2]}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.7)
    return 3


EPISODE_KINDS: list[tuple[str, Episode]] = [
    ("plain", plain_episode),
    ("truncated", truncated_episode),
    ("n=2", branching_episode),
    ("streamed", streaming_episode),
]


async def _run_episodes(base_url: str, episodes: int, out: Path) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        rows = []
        for index in range(episodes):
            kind, episode = EPISODE_KINDS[index % len(EPISODE_KINDS)]
            session_id = f"demo-{index:03d}"
            client = openai.AsyncOpenAI(base_url=f"{base_url}/sessions/{session_id}/v1", api_key="unused")
            turns = await episode(client, model, QUESTIONS[index % len(QUESTIONS)])
            await client.close()
            export = (await http.get(f"/sessions/{session_id}/export")).json()
            rows.append({"kind": kind, "turns": turns, "export": export})
        out.mkdir(parents=True, exist_ok=True)
        with (out / "sessions.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row["export"]) + "\n")
        listed = (await http.get("/sessions")).json()["data"]
        exports = {
            s["session_id"]: (await http.get(f"/sessions/{s['session_id']}/export?texts=true")).json() for s in listed
        }
        (out / "viewer.html").write_text(static_page({"sessions": listed, "exports": exports}), encoding="utf-8")
        return rows


def run_demo(*, episodes: int, out: Path, port: int) -> None:
    console = Console()
    with console.status("starting tokentape serve on the embedded model"), running_server(port=port) as server:
        console.print(f"gateway up at {server.base_url}")
        with console.status(f"running {episodes} episodes"):
            rows = asyncio.run(_run_episodes(server.base_url, episodes, out))
    table = Table(title="tokentape demo")
    for column in ("session", "kind", "turns", "branches", "tokens", "sampled", "rewrites"):
        table.add_column(column, justify="right" if column not in ("session", "kind") else "left")
    totals = {"turns": 0, "tokens": 0, "sampled": 0, "rewrites": 0}
    for row in rows:
        summary = row["export"]["summary"]
        table.add_row(
            row["export"]["session_id"],
            row["kind"],
            str(summary["turns"]),
            str(summary["branches"]),
            str(summary["tokens"]),
            str(summary["sampled_tokens"]),
            str(summary["rewrites"]),
        )
        totals["turns"] += summary["turns"]
        totals["tokens"] += summary["tokens"]
        totals["sampled"] += summary["sampled_tokens"]
        totals["rewrites"] += summary["rewrites"]
    console.print(table)
    console.print(
        f"episodes: {len(rows)}  turns: {totals['turns']}  tokens recorded: {totals['tokens']} "
        f"({totals['sampled']} sampled)  rewrites detected: {totals['rewrites']}"
    )
    console.print(f"export: {out / 'sessions.jsonl'} (one session per line, every branch token-exact)")
    console.print(f"viewer: {out / 'viewer.html'} (open in a browser: every token, its origin and logprob)")
    console.print(
        "your own agent: run `tokentape serve`, then point any OpenAI client at "
        "base_url='http://127.0.0.1:8000/sessions/<episode-id>/v1' (or send header X-Session-ID), "
        "and fetch GET /sessions/<episode-id>/export afterwards."
    )

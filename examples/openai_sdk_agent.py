"""A plain agent that knows nothing of tokentape: only the `openai` SDK and a per-episode base_url.

tokentape serve &            # in another terminal
python examples/openai_sdk_agent.py --episode my-episode-1
curl http://127.0.0.1:8000/sessions/my-episode-1/export
"""

from __future__ import annotations

import argparse
import asyncio

import openai


async def run(base: str, episode: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base}/sessions/{episode}/v1", api_key="unused")
    model = (await client.models.list()).data[0].id
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "Give me a word that rhymes with cat."}
    ]
    for follow_up in ("Use it in a sentence.", "Now a shorter one."):
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=48)
        text = reply.choices[0].message.content or ""
        print(f"assistant: {text}")
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
    await client.close()
    print(f"training data: GET {base}/sessions/{episode}/export")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    parser.add_argument("--episode", default="example-episode")
    args = parser.parse_args()
    asyncio.run(run(args.base, args.episode))

"""Embedded engine throughput: tokens/s through `tokentape serve` (the embedded SmolLM2 GGUF, the real
openai SDK as client) beside llama-cpp-python driving the same model directly, with the same threads,
the same context and batch sizes, and the same token prompts (the gateway's own rendering of the
chats). Greedy decoding on both sides, so both generate the same tokens; streamed and not. Rounds
alternate between the two and the table shows medians.

    python benchmarks/embedded.py [--rounds 3] [--prompts 6] [--max-tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx2
import openai

from tokentape.engines.llamacpp import default_threads
from tokentape.launcher import running_server
from tokentape.render.renderer import RenderOptions
from tokentape.runtime import embedded_model_path, gguf_renderer

QUESTIONS = [
    "Name three primary colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "List four animals that live in the ocean.",
    "How many days are there in a leap year?",
    "Give one tip for writing clear code.",
    "What does a thermometer measure?",
]
MODEL = "smollm2-135m-instruct"  # the name `tokentape serve` derives from the embedded file
CONTEXT = 8192  # `tokentape serve`'s default context length
BATCH = 512  # and its batch size


def chats(count: int) -> list[list[dict[str, Any]]]:
    return [
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": q}]
        for q in (QUESTIONS * (count // len(QUESTIONS) + 1))[:count]
    ]


def direct(llama: Any, prompts: list[list[int]], max_tokens: int, stream: bool) -> tuple[int, float]:
    """Tokens generated and seconds taken by llama-cpp-python alone."""
    generated = 0
    start = time.perf_counter()
    for prompt in prompts:
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "top_k": 0, "top_p": 1.0}
        if stream:
            chunks = llama.create_completion(prompt, stream=True, min_p=0.0, **kwargs)
            generated += sum(1 for chunk in chunks if chunk["choices"][0]["finish_reason"] is None)  # one a token
        else:
            generated += llama.create_completion(prompt, min_p=0.0, **kwargs)["usage"]["completion_tokens"]
    return generated, time.perf_counter() - start


async def through_gateway(
    base_url: str, messages: list[list[dict[str, Any]]], max_tokens: int, stream: bool
) -> tuple[int, float]:
    generated = 0
    async with httpx2.AsyncClient(timeout=600) as http:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, http_client=http)
        start = time.perf_counter()
        for chat in messages:
            if stream:
                chunks = await client.chat.completions.create(
                    model=MODEL,
                    messages=chat,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    temperature=0.0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in chunks:
                    if chunk.usage is not None:
                        generated += chunk.usage.completion_tokens
            else:
                reply = await client.chat.completions.create(
                    model=MODEL,
                    messages=chat,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    temperature=0.0,
                )
                assert reply.usage is not None
                generated += reply.usage.completion_tokens
        return generated, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=default_threads())
    args = parser.parse_args()

    import llama_cpp

    renderer = gguf_renderer(embedded_model_path())
    messages = chats(args.prompts)
    prompts = [renderer.prompt(chat, RenderOptions()).tokens for chat in messages]
    llama = llama_cpp.Llama(
        str(embedded_model_path()),
        n_ctx=CONTEXT,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=BATCH,
        flash_attn=False,
        verbose=False,
    )
    rates: dict[str, list[float]] = {}
    serve = ["--threads", str(args.threads), "--context-length", str(CONTEXT), "--store", ":memory:"]
    with running_server(serve) as server:
        asyncio.run(through_gateway(server.base_url, messages[:1], 4, False))  # warm up
        direct(llama, prompts[:1], 4, False)
        for round_ in range(args.rounds):
            for stream in (False, True):
                kind = "streamed" if stream else "non-streamed"
                runs = [
                    ("llama-cpp-python", lambda s=stream: direct(llama, prompts, args.max_tokens, s)),
                    (
                        "tokentape",
                        lambda s=stream: asyncio.run(through_gateway(server.base_url, messages, args.max_tokens, s)),
                    ),
                ]
                for name, run in runs if round_ % 2 == 0 else runs[::-1]:
                    tokens, seconds = run()
                    rates.setdefault(f"{kind}:{name}", []).append(tokens / seconds)
    print(
        f"embedded SmolLM2-135M Q4_1, {args.threads} thread(s), greedy, "
        f"{args.prompts} prompts x up to {args.max_tokens} tokens, {args.rounds} rounds"
    )
    print(f"{'':>14} {'llama-cpp-python tok/s':>23} {'tokentape tok/s':>16} {'ratio':>7}")
    for kind in ("non-streamed", "streamed"):
        ours = [rates[f"{kind}:tokentape"][i] / rates[f"{kind}:llama-cpp-python"][i] for i in range(args.rounds)]
        print(
            f"{kind:>14} {statistics.median(rates[f'{kind}:llama-cpp-python']):>23.1f} "
            f"{statistics.median(rates[f'{kind}:tokentape']):>16.1f} {statistics.median(ours):>6.2f}x"
        )
    llama.close()


if __name__ == "__main__":
    main()

"""Embedded engine throughput: tokens/s through `tokentape serve` (the embedded SmolLM2 GGUF, the real
openai SDK as client) beside llama-cpp-python driving the same model directly, with the same threads,
the same context and batch sizes, and the same token prompts (the gateway's own rendering of the
chats). Greedy decoding on both sides, so both generate the same tokens; streamed and not. Rounds
alternate between the two and the table shows medians.

    python benchmarks/embedded.py [--rounds 3] [--prompts 6] [--max-tokens 64] [--threads 1]

Concurrent multi-turn sessions (`--sessions 1,4,16,64`): that many sessions at once, each `--turns`
turns of up to `--max-tokens` greedy tokens (the history grows: the assistant's answer and a new user
message each turn), through the gateway in-process on the trainer's weights (the F32 copy, F32 KV
cache: what `tokentape train` serves), each session with its own client. It prints completion
tokens/s, the median and p90 latency of a turn, and the engine's prefill spared per turn. `--server
URL` runs the same sessions against an OpenAI-compatible server instead (llama.cpp's `llama-server
-np N` on the same GGUF), each turn sending the whole history.

    python benchmarks/embedded.py --sessions 1,4,16,64 --turns 3 --max-tokens 16 [--parallel 16]

Beside llama.cpp's own server (`--llama-server BIN`): `tokentape serve` as it starts by default (the
shipped Q4_1 GGUF, its default threads and parallel; `--serve-args` adds options) and `llama-server`
on the same GGUF with `-t THREADS -np N` (N = the sessions), both as processes of their own, driven by
the same client: 1 and 16 concurrent two-turn sessions (`--sessions`), up to `--max-tokens` tokens a
turn at the client's default sampling (temperature 1), rounds interleaved, medians of completion
tokens/s. The machine's load average is printed with each row.

    python benchmarks/embedded.py --llama-server path/to/llama-server --sessions 1,16 --turns 2 --max-tokens 96
        [--rounds 3] [--server-threads 2] [--serve-args "--threads 2"] [--earlier-sessions 40]

`--serve-args` again adds another `tokentape serve` variant to the same rounds (`--serve-args ""
--serve-args "--flash-attention off"`: the default beside flash attention off); `--earlier-sessions N`
first has each server serve N other sessions, as a server that has been up a while has (their KV stays
cached in tokentape's slots; llama-server's slots keep only their last prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
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


def first_message(count: int, index: int) -> str:
    """A question of its own per session and run (only the chat template's system prompt is common)."""
    return f"[{count}/{index}] {QUESTIONS[index % len(QUESTIONS)]}"


FOLLOW_UPS = ["Tell me more.", "Say it in one sentence.", "Thanks! Anything else?", "Why?"]


@dataclass
class SessionsRun:
    tokens: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # what the engine was given, over all turns
    saved: int = 0  # of which its cache spared computing

    def row(self, sessions: int) -> str:
        latencies = sorted(self.latencies)
        p90 = latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))]
        spared = f"{self.saved / self.prompt_tokens:6.1%}" if self.prompt_tokens else "     -"
        turns = len(latencies) or 1
        return (
            f"{sessions:>8} {self.tokens / self.seconds:>8.1f} {statistics.median(latencies):>9.2f} {p90:>7.2f} "
            f"{spared:>8} {self.saved / turns:>12.0f}"
        )


async def session(
    client: openai.AsyncOpenAI,
    model: str,
    first: str,
    turns: int,
    max_tokens: int,
    run: SessionsRun,
    greedy: bool = True,
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    sampling: dict[str, Any] = {"temperature": 0.0} if greedy else {}
    for turn in range(turns):
        start = time.perf_counter()
        reply = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            **sampling,
        )
        run.latencies.append(time.perf_counter() - start)
        assert reply.usage is not None
        run.tokens += reply.usage.completion_tokens
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
        ]


async def sessions_in_process(
    count: int, args: argparse.Namespace, gateway: Any, engine: Any, tag: int | None = None
) -> SessionsRun:
    run = SessionsRun()
    before = engine.describe()
    prefix = f"bench-{count}-{time.monotonic_ns()}"
    clients = []
    for i in range(count):
        await gateway.create_session(f"{prefix}-{i}")
        clients.append(gateway.client(session_id=f"{prefix}-{i}"))
    start = time.perf_counter()
    await asyncio.gather(
        *(
            session(c, gateway.model, first_message(count if tag is None else tag, i), args.turns, args.max_tokens, run)
            for i, c in enumerate(clients)
        )
    )
    run.seconds = time.perf_counter() - start
    after = engine.describe()
    if "prompt_tokens" in after:
        run.prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
        run.saved = after["prefill_tokens_saved"] - before["prefill_tokens_saved"]
    return run


async def sessions_on_server(
    count: int, args: argparse.Namespace, tag: int | None = None, *, url: str | None = None, greedy: bool = True
) -> SessionsRun:
    run = SessionsRun()
    async with httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=count + 4)) as http:
        base = url or args.server
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="bench", max_retries=0, http_client=http)
        model = MODEL if url else "model"
        start = time.perf_counter()
        first = [first_message(count if tag is None else tag, i) for i in range(count)]
        await asyncio.gather(
            *(session(client, model, first[i], args.turns, args.max_tokens, run, greedy) for i in range(count))
        )
        run.seconds = time.perf_counter() - start
    return run


def concurrent_sessions(args: argparse.Namespace) -> None:
    counts = [int(c) for c in args.sessions.split(",")]
    label = f"server {args.server}" if args.server else f"tokentape in-process, parallel {args.parallel or 'default'}"
    print(
        f"{label}: F32 SmolLM2-135M, F32 KV, {args.threads} thread(s), greedy, {args.turns} turns x up to "
        f"{args.max_tokens} tokens per session"
    )
    print(f"{'sessions':>8} {'tok/s':>8} {'turn p50 s':>9} {'p90 s':>7} {'spared':>8} {'spared/turn':>12}", flush=True)
    if args.server:
        asyncio.run(sessions_on_server(1, args, tag=0))  # warm up
        for count in counts:
            print(asyncio.run(sessions_on_server(count, args)).row(count), flush=True)
    else:
        asyncio.run(_in_process(counts, args))


async def _in_process(counts: list[int], args: argparse.Namespace) -> None:
    from tokentape.client import InProcessGateway
    from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
    from tokentape.served import ServeSpec
    from tokentape.train.weights import f32_gguf

    path = f32_gguf(embedded_model_path())
    options: dict[str, Any] = {"parallel": args.parallel} if args.parallel else {}
    engine = LlamaCppEngine(
        LlamaCppSettings(model_path=path, context_length=2048, threads=args.threads, kv_cache_f32=True, **options)
    )
    gateway = InProcessGateway(ServeSpec(model=path, context_length=2048), engine=engine)
    try:
        await sessions_in_process(1, args, gateway, engine, tag=0)  # warm up
        for count in counts:
            print((await sessions_in_process(count, args, gateway, engine)).row(count), flush=True)
    finally:
        await gateway.aclose()


def beside_llama_server(args: argparse.Namespace) -> None:
    """`tokentape serve` on its defaults and llama-server on the same GGUF, one process each, in
    interleaved rounds: completion tokens/s at each count of concurrent sessions."""
    import contextlib
    import shlex
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from overhead import process  # a child process, waited for healthy, stopped on exit

    from tokentape.launcher import free_port

    logs = Path(tempfile.mkdtemp(prefix="tokentape-embedded-"))

    variants = {f"tokentape {extra}".strip(): extra for extra in args.serve_args or [""]}

    def launched(name: str, port: int, count: int) -> contextlib.AbstractContextManager[object]:
        if name in variants:
            return running_server(["--store", ":memory:", *shlex.split(variants[name])], port=port)
        # llama-server's context is shared by its slots: the same per-sequence room as tokentape's
        command = [args.llama_server, "-m", gguf, "--port", str(port), "-t", str(args.server_threads)]
        command += ["-np", str(count), "-c", str(CONTEXT * count), "--no-webui"]
        return process(command, f"http://127.0.0.1:{port}/health", logs / f"llama-server-{port}.log")

    gguf = str(embedded_model_path())
    counts = [int(c) for c in args.sessions.split(",")]
    rates: dict[tuple[int, str], list[float]] = {}
    for round_ in range(args.rounds):
        for count in counts:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            names = [*variants, "llama-server"]
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:  # each first in turn
                with launched(name, port, count):
                    asyncio.run(sessions_on_server(1, args, tag=0, url=url, greedy=False))  # warm up
                    if args.earlier_sessions:  # what a server that has served others holds
                        asyncio.run(sessions_on_server(args.earlier_sessions, args, tag=-1, url=url, greedy=False))
                    run = asyncio.run(sessions_on_server(count, args, tag=round_, url=url, greedy=False))
                rates.setdefault((count, name), []).append(run.tokens / run.seconds)
                print(
                    f"round {round_} {name:>12} {count:>3} sessions: {run.tokens / run.seconds:7.1f} tok/s "
                    f"(load average {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    print(
        f"\nSmolLM2-135M Q4_1 (the shipped GGUF), {args.turns} turns x up to {args.max_tokens} tokens a session, "
        f"client's default sampling; {args.earlier_sessions} sessions served before the measured ones; "
        f"llama-server -t {args.server_threads} -np <sessions>; medians of {args.rounds} rounds"
    )
    print(f"{'sessions':>8} {'llama-server tok/s':>19}  tokentape tok/s and ratio")
    for count in counts:
        theirs_rate = statistics.median(rates[(count, "llama-server")])
        ours = [(name, statistics.median(rates[(count, name)])) for name in variants]
        cells = ", ".join(f"{name}: {rate:.1f} ({rate / theirs_rate:.2f}x)" for name, rate in ours)
        print(f"{count:>8} {theirs_rate:>19.1f}  {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--sessions", help="concurrent multi-turn sessions, e.g. 1,4,16,64")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=0, help="the engine's parallel setting (0: its default)")
    parser.add_argument("--server", help="an OpenAI-compatible server to run the sessions against instead")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary: tokentape serve beside it")
    parser.add_argument("--server-threads", type=int, default=os.cpu_count() or 1, help="llama-server's -t")
    parser.add_argument(
        "--serve-args", action="append", help="options added to `tokentape serve`; again for another variant"
    )
    parser.add_argument(
        "--earlier-sessions", type=int, default=0, help="sessions each server serves before the measured ones"
    )
    args = parser.parse_args()
    if args.llama_server:
        beside_llama_server(args)
        return
    if args.sessions:
        concurrent_sessions(args)
        return

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

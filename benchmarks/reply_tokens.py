"""What a reply's length costs a gateway: CPU per call for short and long replies, whole and streamed,
tokentape beside rllm-model-gateway 0.1.0 (the peer) and the engine called directly, rounds
interleaved. The difference between the long and the short reply, divided by the tokens between
them, is the gateway's CPU per sampled token.

Harness: benchmarks/scripted_vllm.py (a test instrument that answers at once, Qwen2.5's vocabulary)
with `--reply-cap` raised, so a text reply runs to `max_tokens`; tokentape calls its token route, the
peer and direct its chat route; streamed, it sends one event per token, as vLLM does: all at once by
default (the events of a burst, as a gateway reads them when it falls behind the engine, and passes
them on together), or `--event-gap-ms` apart (one token a read, as from an engine that samples one
token a step while the gateway keeps up). Each call is
one user message in a new session (the history stays short: this measures the reply alone), one
call at a time, so each call's CPU is its own (read from /proc in 10 ms ticks, summed over
`--calls` calls a cell).

    python benchmarks/reply_tokens.py [--short 16] [--long 400] [--calls 60] [--rounds 3] [--event-gap-ms 0]
        [--baseline-commit REV]

`--baseline-commit REV` runs tokentape at that commit too (a git worktree), in the same rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import (  # the same harness: processes, the peer's virtualenv, CPU from /proc
    PEER_NAME,
    _client,
    checkout,
    cpu_seconds,
    free_port,
    model_dir,
    peer_python,
    process,
    scripted_engine,
    tokentape_command,
)

TOKENTAPE = "tokentape"
DIRECT = "direct"


async def cell(
    http: httpx2.AsyncClient, base: str, pid: int | None, tag: str, tokens: int, stream: bool, calls: int
) -> float:
    """Gateway CPU ms per call (0 for direct) over `calls` one-message sessions."""
    before = cpu_seconds(pid) if pid else 0.0
    for i in range(calls):
        client = _client(http, base.format(session=f"{tag}-{i}"))
        request = {"model": "scripted", "messages": [{"role": "user", "content": f"Call {i}: go on."}]}
        if stream:
            text = ""
            async for chunk in await client.chat.completions.create(**request, max_tokens=tokens, stream=True):
                text += "".join(c.delta.content or "" for c in chunk.choices)
            words = len(text.split())  # a word a token, the end of the turn aside
            assert words >= tokens - 2, f"{tag}: {words} words streamed for {tokens} tokens"
        else:
            reply = await client.chat.completions.create(**request, max_tokens=tokens)
            assert reply.usage is not None and reply.usage.completion_tokens == tokens, reply.usage
    return 1000 * (cpu_seconds(pid) - before) / calls if pid else 0.0


async def main(args: argparse.Namespace) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="tokentape-reply-"))
    tokenizer = model_dir(argparse.Namespace(template="qwen2.5", tokenizer=None), scratch)
    engine_port, ours_port, peer_port = free_port(), free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, True)
        cap = str(max(args.long, args.short) + 1)
        options = ["--reply-cap", cap, "--event-gap-ms", str(args.event_gap_ms)]
        stack.enter_context(scripted_engine(engine_port, tokenizer, scratch / "engine.log", *options))
        command = tokentape_command(ours_port, engine, scratch / "t.sqlite3", tokenizer)
        ours = stack.enter_context(process(command, f"http://127.0.0.1:{ours_port}/health", scratch / "t.log"))
        peer_command = [str(peer_python()), "-m", "rllm_model_gateway", "--host", "127.0.0.1", "--port", str(peer_port)]
        peer_command += ["--worker", f"{engine}/v1", "--db-path", str(scratch / "peer.db"), "--log-level", "warning"]
        peer = stack.enter_context(process(peer_command, f"http://127.0.0.1:{peer_port}/health", scratch / "peer.log"))
        targets = {
            TOKENTAPE: (f"http://127.0.0.1:{ours_port}/sessions/{{session}}/v1", ours.pid),
            PEER_NAME: (f"http://127.0.0.1:{peer_port}/sessions/{{session}}/v1", peer.pid),
            DIRECT: (f"{engine}/v1", None),
        }
        for rev in args.baseline_commit:
            source, port = stack.enter_context(checkout(rev, scratch)), free_port()
            command = tokentape_command(port, engine, scratch / f"{rev}.sqlite3", tokenizer)
            env = {**os.environ, "PYTHONPATH": str(source / "src")}
            log = scratch / f"{rev}.log"
            baseline = stack.enter_context(process(command, f"http://127.0.0.1:{port}/health", log, env=env))
            targets[f"{TOKENTAPE}@{rev}"] = (f"http://127.0.0.1:{port}/sessions/{{session}}/v1", baseline.pid)
        shapes = [(tokens, stream) for stream in (False, True) for tokens in (args.short, args.long)]
        cpu: dict[tuple[str, int, bool], list[float]] = {}
        async with httpx2.AsyncClient(timeout=120) as http:
            for name, (base, pid) in targets.items():  # warm up: imports, connections, first sessions
                for tokens, stream in shapes:
                    await cell(http, base, pid, f"warm-{name.replace('@', '-')}-{tokens}-{stream}", tokens, stream, 3)
            for round_ in range(args.rounds):
                order = list(targets) if round_ % 2 == 0 else list(reversed(targets))
                for name in order:
                    base, pid = targets[name]
                    for tokens, stream in shapes:
                        tag = f"r{round_}-{name.replace('@', '-')}-{tokens}-{stream}"
                        cpu.setdefault((name, tokens, stream), []).append(
                            await cell(http, base, pid, tag, tokens, stream, args.calls)
                        )
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
        between = args.long - args.short
        gateways = [name for name in targets if name != DIRECT]
        print(f"\ngateway CPU per call (ms, median of {args.rounds} rounds of {args.calls} calls) and per token (us)")
        print("| | " + " | ".join(gateways) + f" | {TOKENTAPE} / peer |")
        print("|---|" + "---:|" * (len(gateways) + 1))
        for stream in (False, True):
            way = "streamed" if stream else "whole"
            for tokens in (args.short, args.long):
                row = {name: statistics.median(cpu[(name, tokens, stream)]) for name in gateways}
                print(f"| {way}, {tokens} tokens: ms a call | {_cells(row, 2)} |")
            per_token = {}
            for name in gateways:
                long_, short = cpu[(name, args.long, stream)], cpu[(name, args.short, stream)]
                per_token[name] = 1000 * (statistics.median(long_) - statistics.median(short)) / between
            print(f"| {way}: us a token | {_cells(per_token, 1)} |")


def _cells(row: dict[str, float], digits: int) -> str:
    ratio = row[TOKENTAPE] / row[PEER_NAME] if row[PEER_NAME] else float("nan")
    return " | ".join(f"{value:.{digits}f}" for value in row.values()) + f" | {ratio:.2f}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=16, help="tokens of the short reply")
    parser.add_argument("--long", type=int, default=400, help="tokens of the long reply")
    parser.add_argument("--calls", type=int, default=60, help="calls a cell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--event-gap-ms", type=float, default=0.0, help="the engine's pause between stream events (0: all at once)"
    )
    parser.add_argument("--baseline-commit", action="append", default=[], help="also run tokentape at this commit")
    asyncio.run(main(parser.parse_args()))

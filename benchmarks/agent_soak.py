"""Memory over time under agent-shaped load: `--agents` (384) agents play agent_load.py's coding-agent
episodes against `tokentape serve --prompt-token-ids asked` for `--minutes` (30), round after round;
each session is finished when its episode ends, as an RL rollout is. Each round prints calls/s, the
gateway's CPU per call, the sessions finished and the gateway's RSS.

    python benchmarks/agent_soak.py [--agents 384] [--minutes 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_load
from overhead import free_port, model_dir, process, rss_mb, scripted_engine, tokentape_command


async def main(args: argparse.Namespace) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="tokentape-agent-soak-"))
    tokenizer = model_dir(argparse.Namespace(template="qwen2.5", tokenizer=None), scratch)
    engine_port, port = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, True)
        stack.enter_context(scripted_engine(engine_port, tokenizer, scratch / "engine.log"))
        command = tokentape_command(port, f"http://127.0.0.1:{engine_port}", scratch / "store.sqlite3", tokenizer)
        command += ["--prompt-token-ids", "asked", "--max-active", str(2 * args.agents)]
        gateway = stack.enter_context(process(command, f"http://127.0.0.1:{port}/health", scratch / "gateway.log"))
        base = f"http://127.0.0.1:{port}"
        target = agent_load.Target("tokentape", base + "/sessions/{session}/v1", gateway.pid)
        start, round_, failed = time.monotonic(), 0, 0
        print(f"RSS at start {rss_mb(gateway.pid):.0f} MB", flush=True)
        async with httpx2.AsyncClient(timeout=60) as http:
            while time.monotonic() - start < args.minutes * 60:
                run = await agent_load.episodes(target, args.agents, agent_load.TURNS, f"s{round_}")
                finished = 0
                for i in range(args.agents):  # episodes() names its sessions {tag}-{agent}-{episode}
                    answer = await http.post(f"{base}/sessions/s{round_}-{i}-0/finish", json={})
                    finished += answer.status_code == 200
                failed += len(run.failures)
                minutes = (time.monotonic() - start) / 60
                print(
                    f"{minutes:5.1f} min, round {round_}: {len(run.latencies)} calls, {run.rate:.0f}/s, "
                    f"{run.cpu_per_request():.2f} ms CPU/call, {finished} finished, "
                    f"RSS {rss_mb(gateway.pid):.0f} MB, {len(run.failures)} failed",
                    flush=True,
                )
                round_ += 1
        print(f"failed calls in all: {failed}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=384)
    parser.add_argument("--minutes", type=float, default=30)
    asyncio.run(main(parser.parse_args()))

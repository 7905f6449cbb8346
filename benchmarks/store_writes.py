"""The store's write path, before and after group commit, measured side by side in one run.

`before`: the store as it was (one thread pool job and one transaction per turn), loaded from git
at the commit given by --before. `after`: the writer thread with group commit. Each of S sessions
writes turns one after another (each awaited before the next, as a request does), all sessions at
once; a turn is a 64-token context and 16 sampled tokens. Printed: turns/s, write latency p50/p99
(from the call to its commit), and transactions per turn (1.0 without grouping). With
`synchronous=FULL` (power-loss durability, one disk sync per transaction) the grouping matters most.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tokentape.core.messages import EMPTY_CHAIN  # noqa: E402
from tokentape.core.session import NewTurn, SessionTree  # noqa: E402
from tokentape.core.tape import Origin, TurnNode  # noqa: E402
from tokentape.store.sqlite import SqliteStore  # noqa: E402


def _before_store(commit: str) -> Any:
    """The store module as it was at `commit`, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{commit}:src/tokentape/store/sqlite.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "store_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("store_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SqliteStore


def _turn(tree: SessionTree, step: int) -> TurnNode:
    parent = tree.nodes[-1] if tree.nodes else None
    turn = NewTurn(
        parent=parent,
        keep=parent.end if parent else 0,
        context=tuple(range(100 + step, 164 + step)),
        context_origin=Origin.PROMPT,
        rewrite=None,
    )
    return tree.attach(
        turn,
        sampled=list(range(500, 516)),
        logprobs=[-0.25] * 16,
        finish_reason="stop",
        prompt_chain=EMPTY_CHAIN,
        prompt_length=2 * step + 1,
        reply={"role": "assistant", "content": "sixteen tokens of reply text"},
    )


async def _run(store: Any, sessions: int, turns: int) -> dict[str, float]:
    latencies: list[float] = []

    async def session(index: int) -> None:
        tree = SessionTree(f"bench-{index}", created_at=time.time())
        for step in range(turns):
            node = _turn(tree, step)
            started = time.perf_counter()
            await store.save_turn(tree, node)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(sessions)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "turns_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
    }


def _synchronous(store: Any, mode: str) -> None:
    """Set the old store's synchronous mode through its own thread (the new one takes it as an argument)."""
    store._run(lambda: store.db.execute(f"PRAGMA synchronous={mode}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default="a424d81", help="git commit of the store before group commit")
    parser.add_argument("--sessions", default="1,8,64")
    parser.add_argument("--turns", type=int, default=2000, help="turns written per configuration")
    args = parser.parse_args()
    before_class = _before_store(args.before)
    print(f"{'store':<8} {'sync':<7} {'sessions':>8} {'turns/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'tx/turn':>8}")
    for mode in ("NORMAL", "FULL"):
        for sessions in [int(s) for s in args.sessions.split(",")]:
            # FULL syncs the disk per transaction (~5 ms here): fewer turns keep the run short
            turns = max(1, (args.turns if mode == "NORMAL" else args.turns // 10) // sessions)
            results = {}
            for name in ("before", "after"):
                with tempfile.TemporaryDirectory() as scratch:
                    path = Path(scratch) / "bench.sqlite3"
                    if name == "before":
                        store = before_class(path)
                        _synchronous(store, mode)
                    else:
                        store = SqliteStore(path, synchronous=mode)  # type: ignore[arg-type]
                    figures = asyncio.run(_run(store, sessions, turns))
                    written = sessions * turns
                    figures["tx_per_turn"] = 1.0 if name == "before" else store.batches / written
                    store.close()
                results[name] = figures
                print(
                    f"{name:<8} {mode:<7} {sessions:>8} {figures['turns_per_s']:>9.0f} {figures['p50_ms']:>8.3f} "
                    f"{figures['p99_ms']:>8.3f} {figures['tx_per_turn']:>8.3f}",
                    flush=True,
                )
            ratio = results["after"]["turns_per_s"] / results["before"]["turns_per_s"]
            print(f"{'':<8} {mode:<7} {sessions:>8} after/before turns/s: {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()

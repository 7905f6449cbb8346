"""Memory per recorded token in live sessions, and RSS growth per 1,000 finished sessions.

Live: `--sessions` sessions of about `--tokens` tokens each are recorded turn by turn into the gateway's
session objects (prompt, then bridge + sampled reply per turn, replies as the assistant messages that
were returned, each request's message chain hashes cached as the gateway caches them), and the
process's RSS growth is divided by the tokens recorded. Logprobs are float32 values, as engines
compute them. Finished: whole episodes run through the gateway (instant scripted engine, SQLite store
in a file), each finished when done; RSS is read after every 1,000.

    python benchmarks/memory.py [--sessions 10000] [--tokens 4000] [--finished 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from tokentape.core.messages import chain_of
from tokentape.core.sampling import SamplingParams
from tokentape.core.session import NewTurn, SessionTree
from tokentape.core.tape import Origin
from tokentape.engines.scripted import ScriptedEngine
from tokentape.gateway.service import ChatCall, Gateway
from tokentape.gateway.sessions import Session, SessionRegistry
from tokentape.runtime import embedded_model_path, gguf_renderer
from tokentape.store.sqlite import SqliteStore

PROMPT, BRIDGE, REPLY = 240, 60, 316  # tokens: first prompt, each bridge, each reply (4,000 in 11 turns)
CHARS_PER_TOKEN = 4


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def record(session_id: str, tokens: int, rng: random.Random) -> Session:
    session = Session(SessionTree(session_id, created_at=time.time()))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."}]
    node = None
    while node is None or node.end < tokens:
        messages.append({"role": "user", "content": f"step {len(messages)}: " + "x" * 200})
        digests = getattr(session, "digests", None)  # absent before the chain cache existed
        chain = digests.chains(messages)[-1] if digests is not None else chain_of(messages)
        ids = [rng.randrange(300, 49_000) for _ in range(PROMPT if node is None else BRIDGE)]
        if node is None:
            turn = NewTurn(None, 0, tuple(ids), Origin.PROMPT, None)
        else:
            turn = NewTurn(node, node.end, tuple(ids), Origin.BRIDGE, None)
        sampled = [rng.randrange(300, 49_000) for _ in range(REPLY)]
        reply = {"role": "assistant", "content": "y" * (REPLY * CHARS_PER_TOKEN)}
        node = session.tree.attach(
            turn,
            sampled=sampled,
            logprobs=[float32(-rng.random() * 3) for _ in sampled],
            finish_reason="stop",
            prompt_chain=chain,
            prompt_length=len(messages),
            reply=reply,
        )
        messages.append(reply)
    return session


def live(sessions: int, tokens: int) -> None:
    rng = random.Random(7)
    gc.collect()
    before = rss_bytes()
    kept = [record(f"s{i}", tokens, rng) for i in range(sessions)]
    gc.collect()
    grown = rss_bytes() - before
    recorded = sum(s.tree.token_count for s in kept)
    sampled = sum(int(s.tree.summary()["sampled_tokens"]) for s in kept)  # type: ignore[call-overload]
    print(
        f"live: {sessions:,} sessions, {recorded:,} tokens ({sampled / recorded:.0%} sampled): "
        f"RSS +{grown / 2**20:,.0f} MB = {grown / recorded:.1f} bytes per recorded token"
    )


async def finished(total: int, turns: int) -> None:
    renderer = gguf_renderer(embedded_model_path())
    end = renderer.tokenizer.encode(renderer.turn_close)[0]
    with tempfile.TemporaryDirectory() as scratch:
        registry = SessionRegistry(SqliteStore(Path(scratch) / "store.sqlite3"))
        gateway = Gateway(ScriptedEngine(list(range(400, 440)), end), renderer, registry)
        gc.collect()
        start = rss_bytes()
        print(f"finished sessions ({turns} turns each, through the gateway, SQLite store in a file):")
        for done in range(1, total + 1):
            messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."}]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Turn {turn}: what next?"})
                call = ChatCall(messages=list(messages), sampling=SamplingParams(max_tokens=48), session_id=f"f{done}")
                content = ""
                async for event in gateway.chat(call):
                    content = getattr(getattr(event, "reply", None), "content", content)
                messages.append({"role": "assistant", "content": content})
            session = await registry.get(f"f{done}")
            session.finish()
            await registry.persist(session)
            if done % 1000 == 0:
                gc.collect()
                print(f"  after {done:>6,}: RSS +{(rss_bytes() - start) / 2**20:7.1f} MB, {len(registry):,} in memory")
        registry.store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=4_000)
    parser.add_argument("--finished", type=int, default=3_000)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    live(args.sessions, args.tokens)
    if args.finished:
        asyncio.run(finished(args.finished, args.turns))


if __name__ == "__main__":
    main()

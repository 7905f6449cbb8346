"""Weight updates on the embedded engine under a live gateway: how long a LoRA swap takes, how long
new generations are held (the update's pause), each phase, and how long turns running when an update
lands wait before they generate on (in_flight=continue). Also a whole-model swap. In process (the
gateway object, as `POST /admin/weights` calls it); adapters written here with gguf.GGUFWriter.

    python benchmarks/weight_updates.py [--updates 20] [--agents 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support.lora

from tests.support.lora import write_lora

from tokentape.core.sampling import SamplingParams
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
from tokentape.gateway.calls import ChatCall
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.runtime import embedded_model_path, gguf_renderer
from tokentape.store.sqlite import SqliteStore


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    median = statistics.median(values)
    return f"median {median * 1000:7.1f} ms   p90 {p90 * 1000:7.1f} ms   max {max(values) * 1000:7.1f} ms"


async def run(args: argparse.Namespace) -> None:
    model = embedded_model_path()
    folder = Path(tempfile.mkdtemp(prefix="tokentape-weights-"))
    adapters = [write_lora(folder / f"a{i}.gguf", seed=i) for i in range(3)]
    engine = LlamaCppEngine(LlamaCppSettings(model_path=model, context_length=2048))
    gateway = Gateway(engine, gguf_renderer(model), SessionRegistry(SqliteStore(":memory:")))
    version = 0

    async def update(**source: Any) -> dict[str, Any]:
        nonlocal version
        version += 1
        report = await gateway.update_weights(version, **source)
        report["swap"] = engine.swap_seconds
        return report

    # 1. idle: nothing running
    idle = [await update(lora=str(adapters[i % 3])) for i in range(args.updates)]

    # 2. under load: agents generating all the time, an update every --interval seconds
    stop = asyncio.Event()
    turns = 0

    async def agent(name: str) -> None:
        nonlocal turns
        step = 0
        while not stop.is_set():
            call = ChatCall(
                messages=[{"role": "user", "content": f"Agent {name}, step {step}: tell a short story."}],
                sampling=SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                session_id=f"{name}-{step}",
            )
            async for _ in gateway.run(call, streamed=step % 2 == 0):
                pass
            turns += 1
            step += 1

    gateway.gate.seam_waits.clear()
    agents = [asyncio.create_task(agent(f"g{i}")) for i in range(args.agents)]
    await asyncio.sleep(args.interval)
    loaded = []
    for i in range(args.updates):
        loaded.append(await update(lora=str(adapters[i % 3])))
        await asyncio.sleep(args.interval)
    stop.set()
    await asyncio.gather(*agents)
    waits = list(gateway.gate.seam_waits)

    # 3. whole model: the same weights from another file
    copy = folder / "model-copy.gguf"
    shutil.copyfile(model, copy)
    whole = [await update(model=str(copy if i % 2 == 0 else model)) for i in range(3)]

    threads = engine.settings.threads or "default"
    print(f"LoRA adapter (rank 8, attn_v + ffn_down, 30 blocks), {args.updates} updates each; threads {threads}")
    for title, reports in (("idle", idle), (f"under load ({args.agents} agents)", loaded), ("whole GGUF", whole)):
        print(f"\n{title}:")
        print(f"  swap (llama.cpp load + set)   {summary([r['swap'] for r in reports])}")
        print(f"  paused (generations held)     {summary([r['paused_seconds'] for r in reports])}")
        for phase in ("check", "hold", "pause", "load", "probe", "resume"):
            print(f"    {phase:<27} {summary([r['phases'][phase] for r in reports])}")
    print(f"\nturns stopped at a seam and continued: {len(waits)} (of {turns} turns); how long each waited:")
    print(f"  {summary(waits)}")
    await gateway.aclose()
    shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between updates under load")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

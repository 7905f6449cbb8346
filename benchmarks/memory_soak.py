"""Memory under a GUI-agent soak: many sessions of many turns, each turn a new 1280x800 screenshot on
top of the whole history's (the repeats), through the images route on the fake vLLM of tests/support
(the real Qwen2-VL tokenizer and processor, the SQLite store). The gateway runs with a small
`--max-memory-bytes` so that the budget is reached early and held for most of the run.

Reported: the process's RSS and the bytes the gateway holds against its budget (sessions' trees,
retry records, image bytes cached or waiting for their write), sampled over the run (a curve), their
peaks, the sessions that left memory, the distinct images the store holds (each once), and the check
that nothing acknowledged was lost (every session's export, read back from the store at the end,
holds every turn it was answered).

    .venv/bin/python benchmarks/memory_soak.py [--sessions 1000] [--turns 30] [--concurrency 8] \
        [--budget-mib 128] [--png docs/figures/memory-soak.png]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from image_storage import screenshot
from tests.images.conftest import Engine, Oracle, open_app
from tests.support import fake_engines
from tests.support.fake_engines import serving, vllm_app
from tests.support.models import materialise

from tokentape.gateway.sessions import MemoryLimits
from tokentape.runtime import hf_renderer


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def new_screen(bases: list[Image.Image], session: int, turn: int) -> bytes:
    """One of a few screens with this turn's own stamp: a new image every turn, like a real screen."""
    image = bases[(session + turn) % len(bases)].copy()
    draw = ImageDraw.Draw(image)
    draw.rectangle((10, 10, 330, 40), fill=(turn * 8 % 256, session % 256, 90))
    draw.text((14, 16), f"session {session} turn {turn}", fill=(255, 255, 255))
    out = io.BytesIO()
    image.save(out, "PNG", compress_level=1)
    return out.getvalue()


async def soak(sessions: int, turns: int, concurrency: int, budget: int) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    root = Path(tempfile.mkdtemp())
    model = materialise("qwen2-vl", root)
    renderer = hf_renderer(model)
    oracle = Oracle(AutoTokenizer.from_pretrained(model), Qwen2VLImageProcessorPil())
    bases = [Image.open(io.BytesIO(screenshot(i))).convert("RGB") for i in range(6)]
    fake_engines.CONTEXT = 1 << 20  # 30 whole screenshots of ~1,300 tokens each
    engine = Engine()
    samples: list[tuple[float, int, int, int, int]] = []  # seconds, RSS, bytes held, in memory, image cache
    answered = [0] * sessions
    refused = 0
    with serving(vllm_app(engine.state)) as url:
        gateway, http = await open_app(renderer, url, engine, root / "tape.db")
        gateway.sessions.limits = MemoryLimits(max_bytes=budget)
        started = time.monotonic()

        async def sample() -> None:
            while True:
                held = gateway.sessions
                cached = held.images.held_bytes
                samples.append((time.monotonic() - started, rss_bytes(), held.held_bytes, len(held), cached))
                await asyncio.sleep(1.0)

        async def agent(n: int) -> None:
            nonlocal refused
            messages: list[dict[str, Any]] = []
            for turn in range(turns):
                data = base64.b64encode(new_screen(bases, n, turn)).decode()
                part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
                messages.append({"role": "user", "content": [{"type": "text", "text": f"Step {turn}."}, part]})
                body = {"model": "m", "messages": messages, "max_tokens": 20}
                while True:
                    engine.state.queued.append(oracle.answer(f"Click {turn}."))
                    response = await http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": f"gui-{n}"})
                    if response.status_code != 429:
                        break
                    refused += 1
                    engine.state.queued.pop()
                    await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                assert response.status_code == 200, response.text
                answered[n] += 1
                messages.append({"role": "assistant", "content": f"Click {turn}."})
                # the instrument's own records of what it was sent: not the gateway's memory
                engine.vision.generations.clear()
                engine.state.requests.clear()
                engine.state.session_headers.clear()

        sampler = asyncio.create_task(sample())
        gate = asyncio.Semaphore(concurrency)

        async def limited(n: int) -> None:
            async with gate:
                await agent(n)

        async with http:
            await asyncio.gather(*(limited(n) for n in range(sessions)))
            sampler.cancel()
            seconds = time.monotonic() - started
            lost = 0
            for n in range(sessions):  # every acknowledged turn, read back (most from the store)
                export = (await http.get(f"/sessions/gui-{n}/export")).json()
                lost += answered[n] - export["summary"]["turns"]
        evicted = gateway.sessions.evicted
        stored = await gateway.sessions.store.image_stats()
        store_reads = gateway.sessions.images.store_reads
        await gateway.aclose()
    return {
        "samples": samples,
        "sessions": sessions,
        "turns": turns,
        "seconds": seconds,
        "budget": budget,
        "peak_rss": max(s[1] for s in samples),
        "peak_held": max(s[2] for s in samples),
        "peak_image_cache": max(s[4] for s in samples),
        "min_rss_after_warmup": min(s[1] for s in samples[len(samples) // 10 :]),
        "stored_images": stored["images"],
        "stored_image_bytes": stored["bytes"],
        "image_store_reads": store_reads,
        "evicted": evicted,
        "refused_429": refused,
        "acknowledged": sum(answered),
        "lost": lost,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = [s[0] for s in result["samples"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.4), dpi=120, sharex=True)
    top.plot(seconds, [s[1] / 2**20 for s in result["samples"]], label="process RSS")
    top.set_ylabel("MiB")
    top.legend(loc="lower right")
    bottom.plot(seconds, [s[2] / 2**20 for s in result["samples"]], label="held against the budget")
    bottom.plot(seconds, [s[4] / 2**20 for s in result["samples"]], label="of which image bytes (cache, pinned)")
    bottom.axhline(result["budget"] / 2**20, color="grey", linestyle="--", label="--max-memory-bytes")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("MiB")
    bottom.legend(loc="lower right")
    top.set_title(f"{result['sessions']} sessions x {result['turns']} turns, a new 1280x800 screenshot each turn")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--budget-mib", type=int, default=128)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    result = asyncio.run(soak(args.sessions, args.turns, args.concurrency, args.budget_mib * 2**20))
    samples = result.pop("samples")
    step = max(1, len(samples) // 12)
    print(f"{'seconds':>8} {'RSS MiB':>8} {'held MiB':>9} {'in memory':>10} {'images MiB':>11}")
    for seconds, rss, held, live, cached in samples[::step]:
        print(f"{seconds:8.0f} {rss / 2**20:8.0f} {held / 2**20:9.1f} {live:10d} {cached / 2**20:11.1f}")
    for name, value in result.items():
        print(f"{name:>14}: {value:,.0f}" if isinstance(value, (int, float)) else f"{name:>14}: {value}")
    if args.png is not None:
        args.png.with_suffix(".json").write_text(json.dumps({**result, "samples": samples}))
        plot({**result, "samples": samples}, args.png)
        print(f"curve: {args.png}")


if __name__ == "__main__":
    main()

"""Memory under a GUI-agent soak: many sessions of many turns, each turn a new 1280x800 screenshot on
top of the whole history's (the repeats), through the images route of a real `tokentape serve`.

Three processes, so that the gateway's memory is its own:
- the gateway, `tokentape serve --engine vllm-generate=URL` with the Qwen2-VL tokenizer, template and
  image processor, a SQLite store, `--prompt-token-ids asked` (a GUI agent reads no prompt IDs) and
  the budget under test (`--max-memory-bytes`, its default 4 GiB unless `--budget-mib` says);
- the stand-in vLLM of the test suite (`tests/support/fake_vision.py`, a test instrument: its render
  route runs transformers' Qwen2-VL image processor for the placeholder count (once per image size)
  and answers `--tensor-mb` of opaque tensors per image, 8 MB being a real 1280x800 screenshot's; its generate
  route checks every image's range and hash, takes an image named by hash only when it was sent its
  tensors before, and answers a few scripted tokens);
- this process, `--concurrency` agents at a time, each a session of `--turns` requests.

Reported, sampled every 2 s: the gateway's RSS (/proc), the bytes it holds against its budget and the
image bytes among them (`/metrics`), sessions in memory; their peaks; the turns acknowledged and
whether every one is in the store (counted with sqlite3 in the store file after the gateway stopped,
and through `GET /sessions/{id}` before); the images the store holds, each once.

    .venv/bin/python benchmarks/memory_soak.py [--sessions 1000] [--turns 30] [--concurrency 8] \
        [--budget-mib 4096] [--tensor-mb 8] [--png docs/figures/memory-soak.png]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from image_storage import screenshot
from tests.support.models import materialise

from tokentape.launcher import free_port, running_server

DEFAULT_BUDGET_MIB = 4096


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
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


def serve_engine(port: int, tensor_bytes: int) -> None:
    """The stand-in vLLM (run as this script's child)."""
    import uvicorn
    from tests.support import fake_engines
    from tests.support.fake_engines import FakeState, vllm_app
    from tests.support.fake_vision import FakeVision

    fake_engines.CONTEXT = 1 << 20  # 30 whole screenshots of ~1,300 tokens each
    state = FakeVision(tensor_bytes, record=False, grid_by_size=True).attach(FakeState(record=False))
    uvicorn.run(vllm_app(state), host="127.0.0.1", port=port, log_level="error")


def metric(text: str, name: str) -> float:
    """A sample's value; of a metric with labels (`tokentape_memory_held_bytes{kind=...}`), their sum."""
    found = [float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{"))]
    return sum(found)


async def soak(sessions: int, turns: int, concurrency: int, budget_mib: int | None, tensor_mb: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp())
    model = materialise("qwen2-vl", root)
    store = root / "tape.db"
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, __file__, "--serve-engine", str(port), "--tensor-mb", str(tensor_mb)],
        stdout=subprocess.DEVNULL,
        stderr=(root / "engine.log").open("wb"),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.2)
    args = ["--engine", f"vllm-generate=http://127.0.0.1:{port}", "--tokenizer", str(model)]
    args += ["--store", str(store), "--prompt-token-ids", "asked"]
    if budget_mib is not None:
        args += ["--max-memory-bytes", str(budget_mib * 2**20)]
    bases = [Image.open(io.BytesIO(screenshot(i))).convert("RGB") for i in range(6)]
    samples: list[tuple[float, int, float, float, float]] = []  # seconds, RSS, held, image bytes, in memory
    answered = [0] * sessions
    refused = 0
    try:
        with running_server(args, log_path=root / "gateway.log") as gateway:
            pid = gateway.process.pid
            base_rss = rss_bytes(pid)
            limits = httpx.Limits(max_connections=concurrency + 2)
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=600, limits=limits) as http:
                budget = metric((await http.get("/metrics")).text, "tokentape_memory_budget_bytes")
                started = time.monotonic()

                async def sample() -> None:
                    while True:
                        text = (await http.get("/metrics")).text
                        samples.append(
                            (
                                time.monotonic() - started,
                                rss_bytes(pid),
                                metric(text, "tokentape_memory_held_bytes"),
                                metric(text, "tokentape_image_cache_bytes"),
                                metric(text, "tokentape_sessions_live"),
                            )
                        )
                        await asyncio.sleep(2.0)

                async def agent(n: int) -> None:
                    nonlocal refused
                    messages: list[dict[str, Any]] = []
                    headers = {"X-Session-ID": f"gui-{n}", "Content-Type": "application/json"}
                    for turn in range(turns):
                        data = base64.b64encode(new_screen(bases, n, turn)).decode()
                        part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
                        text = {"type": "text", "text": f"Step {turn}."}
                        messages.append({"role": "user", "content": [text, part]})
                        body = orjson.dumps({"model": "fake-model", "messages": messages, "max_tokens": 12})
                        while True:
                            response = await http.post("/v1/chat/completions", content=body, headers=headers)
                            if response.status_code not in (429, 503):
                                break
                            refused += 1
                            await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                        assert response.status_code == 200, response.text
                        answered[n] += 1
                        reply = response.json()["choices"][0]["message"]["content"]
                        messages.append({"role": "assistant", "content": reply})

                sampler = asyncio.create_task(sample())
                gate = asyncio.Semaphore(concurrency)

                async def limited(n: int) -> None:
                    async with gate:
                        await agent(n)

                await asyncio.gather(*(limited(n) for n in range(sessions)))
                seconds = time.monotonic() - started
                sampler.cancel()
                text = (await http.get("/metrics")).text
                resends = metric(text, "tokentape_engine_image_resends")
                served = {}  # every acknowledged turn, through the gateway (most sessions read back from the store)
                for n in range(sessions):
                    served[n] = (await http.get(f"/sessions/gui-{n}")).json()["turns"]
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    # and in the store file itself, after the gateway stopped
    with sqlite3.connect(store) as db:
        stored = dict(db.execute("SELECT session_id, COUNT(*) FROM turns GROUP BY session_id").fetchall())
        images, image_bytes = db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(data)), 0) FROM images").fetchone()
    return {
        "samples": samples,
        "sessions": sessions,
        "turns": turns,
        "concurrency": concurrency,
        "tensor_mb": tensor_mb,
        "seconds": seconds,
        "budget": budget,
        "rss_at_start": base_rss,
        "peak_rss": max(s[1] for s in samples),
        "peak_held": max(s[2] for s in samples),
        "peak_image_bytes": max(s[3] for s in samples),
        "acknowledged": sum(answered),
        "lost_per_gateway": sum(answered[n] - served[n] for n in range(sessions)),
        "lost_in_store": sum(answered[n] - stored.get(f"gui-{n}", 0) for n in range(sessions)),
        "refused_429_503": refused,
        "image_resends": resends,
        "stored_images": images,
        "stored_image_bytes": image_bytes,
        "store_file_bytes": os.path.getsize(store),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s[0] / 60 for s in result["samples"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.4), dpi=120, sharex=True)
    top.plot(minutes, [s[1] / 2**20 for s in result["samples"]], label="gateway RSS")
    top.axhline(result["budget"] / 2**20, color="grey", linestyle="--", label="--max-memory-bytes")
    top.set_ylabel("MiB")
    top.set_ylim(bottom=0)
    top.legend(loc="lower right")
    bottom.plot(minutes, [s[2] / 2**20 for s in result["samples"]], label="held against the budget")
    bottom.plot(minutes, [s[3] / 2**20 for s in result["samples"]], label="of which image bytes")
    bottom.set_xlabel("minutes")
    bottom.set_ylabel("MiB")
    bottom.set_ylim(bottom=0)
    bottom.legend(loc="lower right")
    top.set_title(
        f"{result['sessions']:,} sessions x {result['turns']} turns, a new 1280x800 screenshot each turn "
        f"({result['concurrency']} at a time)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--budget-mib", type=int, default=None, help=f"default: serve's own, {DEFAULT_BUDGET_MIB}")
    parser.add_argument("--tensor-mb", type=float, default=8.0)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--serve-engine", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine is not None:
        serve_engine(args.serve_engine, int(args.tensor_mb * 1e6))
        return
    result = asyncio.run(soak(args.sessions, args.turns, args.concurrency, args.budget_mib, args.tensor_mb))
    samples = result.pop("samples")
    step = max(1, len(samples) // 15)
    print(f"{'minutes':>8} {'RSS MiB':>8} {'held MiB':>9} {'images MiB':>11} {'in memory':>10}")
    for seconds, rss, held, images, live in samples[::step]:
        print(f"{seconds / 60:8.1f} {rss / 2**20:8.0f} {held / 2**20:9.1f} {images / 2**20:11.1f} {live:10.0f}")
    for name, value in result.items():
        print(f"{name:>20}: {value:,.0f}" if isinstance(value, (int, float)) else f"{name:>20}: {value}")
    if args.png is not None:
        args.png.with_suffix(".json").write_text(json.dumps({**result, "samples": samples}))
        plot({**result, "samples": samples}, args.png)
        print(f"curve: {args.png}")


if __name__ == "__main__":
    main()

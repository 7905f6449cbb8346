"""Bytes stored for the screenshots of a GUI episode: what the requests carried against what the store
keeps once images are stored by content.

A 30-turn episode through the gateway (the real Qwen2-VL tokenizer and processor, the fake vLLM of
tests/support as the engine, the SQLite store): each turn the agent sends its whole history back, as
agents do, with a new screenshot; the screen repeats itself (the agent moves between `--screens`
distinct screens). Reported: image bytes the requests carried, bytes a store that keeps each turn's
request images would hold, bytes the store holds (one row per distinct image), and the per turn
figures.

    .venv/bin/python benchmarks/image_storage.py [--turns 30] [--screens 6]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.images.conftest import Engine, Oracle, open_app
from tests.support import fake_engines
from tests.support.fake_engines import serving, vllm_app
from tests.support.models import materialise

from tokentape.runtime import hf_renderer


def screenshot(index: int, size: tuple[int, int] = (1280, 800)) -> bytes:
    """A synthetic UI screen: panels, buttons and text-like noise (compresses like a real one, roughly)."""
    rng = random.Random(index)
    image = Image.new("RGB", size, (245, 246, 248))
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x, y = rng.randrange(size[0] - 200), rng.randrange(size[1] - 60)
        colour = tuple(rng.randrange(60, 230) for _ in range(3))
        draw.rectangle((x, y, x + rng.randrange(40, 200), y + rng.randrange(16, 60)), fill=colour)  # type: ignore[arg-type]
    for _ in range(300):
        x, y = rng.randrange(size[0] - 80), rng.randrange(size[1] - 12)
        draw.text((x, y), "".join(rng.choice("abcdefghij klmnop") for _ in range(12)), fill=(20, 20, 20))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


async def episode(turns: int, screens: int) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    root = Path(tempfile.mkdtemp())
    model = materialise("qwen2-vl", root)
    renderer = hf_renderer(model)
    oracle = Oracle(AutoTokenizer.from_pretrained(model), Qwen2VLImageProcessorPil())
    shots = [screenshot(i) for i in range(screens)]
    fake_engines.CONTEXT = 1 << 20  # 30 whole screenshots of ~1,300 tokens each
    engine = Engine()
    carried = kept_per_turn = 0
    with serving(vllm_app(engine.state)) as url:
        gateway, http = await open_app(renderer, url, engine, root / "tape.db")
        async with http:
            messages: list[dict[str, Any]] = []
            for turn in range(turns):
                shot = shots[turn % screens]
                part = {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64," + base64.b64encode(shot).decode()},
                }
                messages.append({"role": "user", "content": [{"type": "text", "text": f"Step {turn}."}, part]})
                engine.state.queued.append(oracle.answer(f"Click {turn}."))
                body = {"model": "m", "messages": messages, "max_tokens": 20}
                response = await http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "gui"})
                assert response.status_code == 200, response.text
                messages.append({"role": "assistant", "content": f"Click {turn}."})
                request_images = [shots[t % screens] for t in range(turn + 1)]
                carried += sum(len(s) for s in request_images)
                kept_per_turn += len(shot)
            store = gateway.sessions.store
            assert store is not None
            stats = await store.image_stats()
        await gateway.aclose()
    return {
        "turns": turns,
        "distinct screens": screens,
        "mean screenshot bytes": sum(len(s) for s in shots) // screens,
        "image bytes the requests carried (whole history each turn)": carried,
        "bytes if each turn stored its request's images": carried,
        "bytes if each turn stored its own new image": kept_per_turn,
        "bytes stored by content (images table)": stats["bytes"],
        "images stored": stats["images"],
        "stored per turn, each turn's request images": round(carried / turns),
        "stored per turn, each turn's new image": round(kept_per_turn / turns),
        "stored per turn, by content": round(stats["bytes"] / turns),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--screens", type=int, default=6)
    args = parser.parse_args()
    for name, value in asyncio.run(episode(args.turns, args.screens)).items():
        print(f"{name:>62}: {value:,}")
    print(f"{'load average':>62}: {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()

"""The viewer draws an image's placeholder run as the image: one thumbnail per run, no pad tokens."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from tests.images.conftest import App, Oracle, data_url, png
from tests.support.browser import chromium
from tokentape.viewer import static_page

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--virtual-time-budget=5000"]


def image(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


async def test_each_placeholder_run_is_one_thumbnail(app: App, oracle: Oracle, tmp_path: Path) -> None:
    binary = chromium()  # skips where there is none
    red, blue = png((200, 30, 30)), png((30, 30, 200), (120, 80))
    app.queue(oracle.answer("Red."), oracle.answer("Blue."))
    first = [{"role": "user", "content": [{"type": "text", "text": "Color?"}, image(red)]}]
    headers = {"X-Session-ID": "viewed"}
    await app.openai.chat.completions.create(model="m", messages=first, max_tokens=20, extra_headers=headers)
    second = [*first, {"role": "assistant", "content": "Red."}, {"role": "user", "content": [image(blue)]}]
    await app.openai.chat.completions.create(model="m", messages=second, max_tokens=20, extra_headers=headers)
    export = (await app.http.get("/sessions/viewed/export", params={"texts": "true"})).json()
    listing = (await app.http.get("/sessions")).json()["data"]
    page = tmp_path / "viewer.html"
    page.write_text(static_page({"sessions": listing, "exports": {"viewed": export}}))

    dom = subprocess.run(
        [
            binary,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            f"{page.as_uri()}#session=viewed",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    (branch,) = export["branches"]
    runs = branch["image_runs"]
    assert dom.count('class="tok thumb') == len(runs) == 2
    # every token is drawn once, except that each run is one element
    hidden = sum(run["end"] - run["start"] - 1 for run in runs)
    assert dom.count("data-origin=") == len(branch["tokens"]) - hidden
    assert dom.count(f'src="{data_url(red)}"') == 1 and dom.count(f'src="{data_url(blue)}"') == 1

"""`make fuzz`'s standing probe of the event loop: each huge request shape of `loop_probe` (10,000
tools, a 6 MB message, 65 large-dimension PNGs to a vision model) sent six at once against a live
gateway, for TOKENTAPE_FUZZ_LOOP_ROUNDS rounds (default 2), while /health is asked every 100 ms and
an honest chat is made on another session. Figures in test-output/loop-lag.json; the exit status is
1 if any window saw /health or the loop held past `HEALTH_BOUND` (2.5 s), or the honest chat slower
than five seconds.

What six at once still cost the loop is their bodies' JSON parse, which holds the GIL wherever it runs:
about 0.1 s for 13.7 MB of tools on an idle core, 0.2-0.3 s on a busy one, and six bodies that arrive
together are parsed back to back (1.2-1.8 s seen on a busy 2-core machine). One huge request alone is
held to a second (`test_loop_lag.py`).

    python -m tests.reliability.loop_fuzz
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import httpx

from tests.conftest import output_dir
from tests.reliability.loop_probe import (
    Window,
    honest_chat,
    huge_message,
    image_chat,
    large_pngs,
    many_tools,
    measure,
)
from tests.support.fake_engines import FakeState, serving, vllm_app
from tests.support.fake_vision import FakeVision
from tests.support.models import materialise
from tokentape.launcher import running_server

EMBEDDED = "smollm2-135m-instruct"
AT_ONCE = 6
HEALTH_BOUND = 2.5  # a bucket bound of the loop-lag histogram


def _embedded(rounds: int) -> list[Window]:
    windows = []
    with running_server(["--store", ":memory:"]) as server:
        for _ in range(rounds):
            for shape, body in (("10,000 tools", many_tools(EMBEDDED)), ("6 MB message", huge_message(EMBEDDED))):
                windows.append(
                    measure(
                        server.base_url,
                        f"{shape} x{AT_ONCE}",
                        body,
                        at_once=AT_ONCE,
                        honest=lambda client: honest_chat(client, "honest-other", EMBEDDED),
                    )
                )
    return windows


def _vision(rounds: int) -> list[Window]:
    windows = []
    model_dir = materialise("qwen2-vl", Path(tempfile.mkdtemp(prefix="loop-fuzz-")))
    state = FakeVision().attach(FakeState())
    with serving(vllm_app(state)) as url:
        args = ["--engine", f"vllm-generate={url}", "--tokenizer", str(model_dir), "--store", ":memory:"]
        with running_server(args) as server:
            model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
            body = image_chat(model, large_pngs(65))
            for _ in range(rounds):
                windows.append(
                    measure(
                        server.base_url,
                        f"65 PNGs of 4096 x 4096 x{AT_ONCE}",
                        body,
                        at_once=AT_ONCE,
                        honest=lambda client: honest_chat(client, "honest-other", model),
                    )
                )
    return windows


def main() -> int:
    rounds = max(1, int(os.environ.get("TOKENTAPE_FUZZ_LOOP_ROUNDS", "2")))
    windows = _embedded(rounds) + _vision(rounds)
    figures = [{**window.as_json(), "problems": window.problems(HEALTH_BOUND)} for window in windows]
    (output_dir() / "loop-lag.json").write_text(json.dumps(figures, indent=2))
    bad = 0
    for window in windows:
        problems = window.problems(HEALTH_BOUND)
        bad += bool(problems)
        print(
            f"{window.shape}: answers {sorted(set(window.statuses))} in at most {max(window.huge_seconds):.1f} s; "
            f"/health at most {window.slowest_health:.2f} s; honest chat {window.honest_seconds:.2f} s"
            + (f"; PROBLEMS: {'; '.join(problems)}" if problems else "")
        )
    print(f"loop probe: {len(windows) - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

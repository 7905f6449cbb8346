"""No request holds the event loop for its size: while a huge request is handled by a served gateway
(`tokentape serve` on loopback, on its defaults), `/health` answers within a second, an honest chat on
another session within five, and the gateway's own loop ticker never wakes a second late.

Three shapes, each inside the body limit: 10,000 tools (13.7 MB) with a one-word message, a 6 MB user
message (both past the embedded model's 8,192-token context: refused with `context_length_exceeded`),
and 65 distinct 4096 x 4096 PNGs of about 50 KB each to a vision model (past the pixels one request may
decode: refused from their headers). Before these were bounded, each held the loop for seconds to
tens of seconds (`/health` 17-47 s behind the tools)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

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
from tokentape.launcher import RunningServer, running_server

EMBEDDED = "smollm2-135m-instruct"
FIGURES: dict[str, dict[str, object]] = {}


@pytest.fixture(scope="module")
def embedded() -> Iterator[RunningServer]:
    with running_server(["--store", ":memory:"]) as server:
        yield server
    (output_dir() / "loop-lag-test.json").write_text(json.dumps(FIGURES, indent=2))


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = materialise("qwen2-vl", tmp_path_factory.mktemp("vl-models"))
    state = FakeVision().attach(FakeState())
    args = ["--engine", "placeholder", "--tokenizer", str(model_dir), "--store", ":memory:"]
    with serving(vllm_app(state)) as url:
        args[1] = f"vllm-generate={url}"
        with running_server(args) as server:
            yield server
    (output_dir() / "loop-lag-test.json").write_text(json.dumps(FIGURES, indent=2))


def _held_well(window: Window) -> None:
    # /health within HEALTH_BOUND, the honest chat within HONEST_BOUND, the ticker never a second late
    assert not window.problems(), (window.problems(), window.as_json())


def _embedded_honest(client: httpx.Client) -> tuple[int, float]:
    return honest_chat(client, "honest-other", EMBEDDED)


def test_ten_thousand_tools_hold_nobody(embedded: RunningServer) -> None:
    window = measure(embedded.base_url, "10,000 tools", many_tools(EMBEDDED), honest=_embedded_honest)
    FIGURES[window.shape] = window.as_json()
    assert window.statuses == [400] and window.codes == ["context_length_exceeded"], window.as_json()
    _held_well(window)


def test_a_six_megabyte_message_holds_nobody(embedded: RunningServer) -> None:
    window = measure(embedded.base_url, "6 MB message", huge_message(EMBEDDED), honest=_embedded_honest)
    FIGURES[window.shape] = window.as_json()
    assert window.statuses == [400] and window.codes == ["context_length_exceeded"], window.as_json()
    _held_well(window)


def test_sixty_four_large_images_hold_nobody(vision: RunningServer) -> None:
    body = image_chat("m", large_pngs(65))
    model = httpx.get(f"{vision.base_url}/v1/models").json()["data"][0]["id"]
    body["model"] = model

    def honest(client: httpx.Client) -> tuple[int, float]:
        return honest_chat(client, "honest-other", model)

    window = measure(vision.base_url, "65 PNGs of 4096 x 4096", body, honest=honest)
    FIGURES[window.shape] = window.as_json()
    assert window.statuses == [400] and window.codes == ["image_too_large"], window.as_json()
    _held_well(window)

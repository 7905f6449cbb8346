"""Image decoding bounded before it starts, and done off the event loop: every image of a request is
checked from its header (size, type, and the pixels the request would decode in all) before any is
decoded; then each is decoded on the worker thread the request is parsed on. An image whose header
passes and whose data does not is still named by its part."""

from __future__ import annotations

import threading

import pytest
from PIL import ImageFile

from tests.images.conftest import App, Oracle, data_url, png
from tests.images.test_rewrites_and_refusals import RED, wire
from tests.reliability.loop_probe import large_pngs
from tokentape.server.dialects.images import ImageLimits


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads Pillow decoded pixels on, one entry per image decoded."""
    seen: list[str] = []
    load = ImageFile.ImageFile.load

    def counted(self: ImageFile.ImageFile) -> object:
        seen.append(threading.current_thread().name)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return seen


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
async def test_images_past_the_pixels_a_request_may_decode_are_refused_before_any_is_decoded(
    app: App, loads: list[str], dialect: str
) -> None:
    limit = ImageLimits().max_total_pixels
    side = 4096
    count = limit // (side * side) + 1  # one image past the bound, each within the per-image limit
    route, body, first = wire(dialect, *(data_url(p) for p in large_pngs(count, side)))
    before = len(app.engine.state.requests)
    response = await app.http.post(route, json=body, headers={"X-Session-ID": f"pixels-{dialect}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    last = first.replace("content[1]", f"content[{count}]")
    assert last in error["message"] and f"{limit:,}" in error["message"], error
    if dialect != "messages":  # Anthropic's error shape has no code
        assert error["code"] == "image_too_large"
    assert loads == []  # not one decoded
    assert len(app.engine.state.requests) == before


async def test_a_truncated_image_is_named_by_its_part(app: App, loads: list[str]) -> None:
    whole = png(RED, (64, 48))
    cut = whole[: len(whole) - 40]  # the header reads; the pixel data ends early
    route, body, _ = wire("chat", data_url(whole), data_url(cut))
    response = await app.http.post(route, json=body, headers={"X-Session-ID": "truncated"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[2]" and error["code"] == "invalid_image", error


async def test_images_are_decoded_off_the_event_loop(app: App, oracle: Oracle, loads: list[str]) -> None:
    image = png((10, 120, 240), (96, 64))
    app.queue(oracle.answer("Blue."))
    route, body, _ = wire("chat", data_url(image))
    response = await app.http.post(route, json=body, headers={"X-Session-ID": "decoded-where"})
    assert response.status_code == 200, response.text
    assert loads and threading.main_thread().name not in loads, loads

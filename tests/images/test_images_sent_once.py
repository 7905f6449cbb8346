"""Each image's tensors reach vLLM once: a later request names an image vLLM was sent before by its
hash alone (null `kwargs_data`), as vLLM's token route allows, and when vLLM no longer holds one (its
bare 500) the generation is sent once more with every image's tensors, and the turn is answered as if
nothing happened. The engine is the fake vLLM of the test suite, whose processor cache is a set of
hashes that a test can empty (a restart) and whose misses it counts; `tests/vllm/test_vllm_vision.py`
runs the same against a real vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from tests.images.conftest import App, Oracle, data_url, png
from tokentape.engines.remote import VLLMGenerateEngine
from tokentape.engines.remote.vllm_images import RenderedImage, SentImages
from tokentape.gateway.generation import ENGINE_ATTEMPTS

SHADES = [(10 * i, 200 - 10 * i, 90) for i in range(1, 8)]


def _ask(image: bytes, text: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}],
    }


def _engine(app: App) -> VLLMGenerateEngine:
    (engine,) = app.gateway.engines()
    assert isinstance(engine, VLLMGenerateEngine)
    return engine


def _sent(app: App) -> list[list[bool]]:
    """For each generate request the fake took with images: which images carried their tensors."""
    return [
        [data is not None for data in body["features"]["kwargs_data"]["image"]]
        for body in app.engine.vision.generations
    ]


async def _conversation(app: App, oracle: Oracle, session: str, images: list[bytes], *, stream: bool) -> list[int]:
    """One turn per image, each turn's image on top of the history's; the statuses."""
    messages: list[dict[str, Any]] = []
    statuses = []
    for turn, image in enumerate(images):
        messages.append(_ask(image, f"Step {turn}."))
        app.queue(oracle.answer(f"Click {turn}."))
        body = {"model": "m", "messages": messages, "max_tokens": 20, "stream": stream}
        response = await app.http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": session})
        statuses.append(response.status_code)
        assert response.status_code == 200, response.text
        messages.append({"role": "assistant", "content": f"Click {turn}."})
    return statuses


@pytest.fixture(autouse=True)
def _fresh_engine(app: App) -> None:
    app.engine.vision.held.clear()
    app.engine.vision.generations.clear()
    app.engine.vision.misses = 0


@pytest.mark.parametrize("stream", [False, True])
async def test_each_image_travels_once_and_later_turns_name_it_by_hash(app: App, oracle: Oracle, stream: bool) -> None:
    shots = [png(shade, (64 + 8 * i, 48)) for i, shade in enumerate(SHADES[:4])]
    await _conversation(app, oracle, f"once-{stream}", shots, stream=stream)
    # turn k shows k images: only the newest brings its tensors, the fake took every request
    assert _sent(app) == [[False] * k + [True] for k in range(4)]
    assert app.engine.vision.misses == 0 and _engine(app).image_resends == 0
    # the tape is what the engine saw: the export's images are the conversation's, in order
    (branch,) = (await app.export(f"once-{stream}"))["branches"]
    assert branch["images"] == [data_url(shot) for shot in shots]


async def test_the_tensors_leave_memory_once_vllm_took_them(app: App, oracle: Oracle) -> None:
    shots = [png(shade, (72, 40)) for shade in SHADES[4:6]]
    await _conversation(app, oracle, "slim", shots, stream=False)
    kept = list(_engine(app)._renders._items.values())
    assert kept and all(render.kwargs_data is None for render, _ in kept)
    assert _engine(app)._renders.held_bytes == sum(8 * len(r.run) + len(r.mm_hash) + 200 for r, _ in kept)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_image_vllm_no_longer_holds_is_sent_again_with_every_images_tensors(
    app: App, oracle: Oracle, stream: bool
) -> None:
    shots = [png(shade, (56, 56 + 8 * i)) for i, shade in enumerate(SHADES[:3])]
    messages: list[dict[str, Any]] = []
    for turn, shot in enumerate(shots[:2]):
        messages += [_ask(shot, f"Step {turn}."), {"role": "assistant", "content": f"Click {turn}."}]
    await _conversation(app, oracle, f"restart-{stream}", shots[:2], stream=stream)
    app.engine.vision.held.clear()  # vLLM restarted: its processor cache is empty
    app.engine.vision.generations.clear()
    messages.append(_ask(shots[2], "Step 2."))
    app.queue(oracle.answer("Click 2."))
    body = {"model": "m", "messages": messages, "max_tokens": 20, "stream": stream}
    response = await app.http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": f"restart-{stream}"})
    assert response.status_code == 200, response.text
    # one miss (the first two named by hash), then the same request with every tensor, taken
    assert app.engine.vision.misses == 1 and _engine(app).image_resends == 1
    assert _sent(app) == [[True, True, True]]
    assert f"tokentape_engine_image_resends {_engine(app).image_resends}.0" in (await app.http.get("/metrics")).text
    (branch,) = (await app.export(f"restart-{stream}"))["branches"]
    assert branch["images"] == [data_url(shot) for shot in shots]
    # and the next turn names all three by hash again
    messages += [{"role": "assistant", "content": "Click 2."}, {"role": "user", "content": "Done?"}]
    app.queue(oracle.answer("Yes."))
    body["messages"] = messages
    response = await app.http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": f"restart-{stream}"})
    assert response.status_code == 200, response.text
    assert _sent(app) == [[True, True, True], [False, False, False]]


async def test_a_failure_is_not_sent_again_when_every_tensor_went_with_it(app: App, oracle: Oracle) -> None:
    """Only a request that named an image by hash is sent once more: an engine that fails requests
    carrying every tensor is tried as any failing engine is (ENGINE_ATTEMPTS times), then a 502."""
    requests = len(app.engine.state.requests)
    app.engine.state.fail_next = 10
    body = {"model": "m", "messages": [_ask(png(SHADES[6], (40, 40)), "Hi.")], "max_tokens": 20}
    response = await app.http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "fails"})
    app.engine.state.fail_next = 0
    assert response.status_code == 502, response.text
    assert len(app.engine.state.requests) == requests + ENGINE_ATTEMPTS and _engine(app).image_resends == 0


async def test_a_resend_that_fails_too_is_the_callers_error(app: App, oracle: Oracle) -> None:
    shot = png(SHADES[5], (44, 60))
    await _conversation(app, oracle, "twice", [shot], stream=False)
    messages = [
        _ask(shot, "Step 0."),
        {"role": "assistant", "content": "Click 0."},
        {"role": "user", "content": "And?"},
    ]
    requests = len(app.engine.state.requests)
    app.engine.state.fail_next = 10
    body = {"model": "m", "messages": messages, "max_tokens": 20}
    response = await app.http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "twice"})
    app.engine.state.fail_next = 0
    assert response.status_code == 502, response.text
    # named by hash, then once more with its tensors; the gateway's own later attempts carry them
    sent = app.engine.state.requests[requests:]
    assert [[d is not None for d in b["features"]["kwargs_data"]["image"]] for b in sent] == [
        [False],
        *[[True]] * ENGINE_ATTEMPTS,
    ]
    assert _engine(app).image_resends == 1


def test_the_mirror_of_vllms_cache_forgets_the_least_recently_used_past_its_bytes() -> None:
    sent = SentImages(max_bytes=250)
    renders = [RenderedImage(f"h{i}", (1, 2, 3), "x" * 100) for i in range(3)]
    sent.took(renders[:2])
    assert "h0" in sent and "h1" in sent
    sent.took([renders[0].without_tensors()])  # h0 named again: h1 is now the least recently used
    sent.took(renders[2:])
    assert ["h0" in sent, "h1" in sent, "h2" in sent] == [True, False, True]
    sent.forget()
    assert not any(f"h{i}" in sent for i in range(3))

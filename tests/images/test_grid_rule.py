"""An image's placeholder count follows from its size alone where the processor's resize rule was
checked against the processor itself: no pixels are processed. Compared here with transformers'
Qwen2-VL processor run on real images of many sizes and under other settings; a processor whose
grid does not follow the rule has every image processed, as before."""

from __future__ import annotations

import hashlib
import io
import random
from typing import Any

import pytest
from PIL import Image

from tokentape.core.images import DecodedImage
from tokentape.errors import InvalidRequest
from tokentape.render.vision import VisionProcessor


def _image(width: int, height: int, seed: int = 0) -> DecodedImage:
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))  # type: ignore[arg-type]
    out = io.BytesIO()
    image.save(out, "PNG")
    data = out.getvalue()
    return DecodedImage(hashlib.sha256(data).hexdigest(), data, "image/png", width, height)


def _processed(processor: Any, image: DecodedImage) -> tuple[int, ...]:
    """The processor's own grid for the image, pixels and all."""
    opened = Image.open(io.BytesIO(image.data)).convert("RGB")
    return tuple(int(v) for v in processor(images=[opened], return_tensors="np")["image_grid_thw"][0])


def _processor_class() -> Any:
    """transformers' Qwen2-VL image processor class, imported when a test runs (its module takes
    about a second, paid by every worker that collects this file otherwise)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


@pytest.mark.parametrize(
    "settings",
    [{}, {"max_pixels": 256 * 28 * 28}, {"min_pixels": 512 * 28 * 28, "max_pixels": 1024 * 28 * 28}],
    ids=["defaults", "small max_pixels", "narrow band"],
)
def test_the_grid_from_the_size_is_the_processors_own(settings: dict[str, int]) -> None:
    processor = _processor_class()(**settings)
    vision = VisionProcessor(processor, 1, 2, 3)
    assert vision.rule_holds
    rng = random.Random(7)
    sizes = [(1280, 800), (1920, 1080), (800, 500), (28, 28), (29, 61)]
    sizes += [(rng.randrange(28, 1600), rng.randrange(28, 1600)) for _ in range(20)]
    for n, (width, height) in enumerate(sizes):
        image = _image(width, height, n)
        assert vision.grid(image) == _processed(processor, image), (width, height, settings)


class _OtherRule:
    """A processor with Qwen2-VL's attributes whose grid follows another rule (halved)."""

    def __init__(self) -> None:
        self.inner = _processor_class()()
        self.size, self.patch_size, self.merge_size = self.inner.size, 14, 2
        self.calls = 0

    def __call__(self, images: list[Image.Image], return_tensors: str) -> dict[str, Any]:
        self.calls += 1
        (image,) = images
        return self.inner(
            images=[image.resize((max(28, image.width // 2), max(28, image.height // 2)))], return_tensors="np"
        )


def test_a_processor_whose_grid_does_not_follow_the_rule_has_its_images_processed() -> None:
    processor = _OtherRule()
    vision = VisionProcessor(processor, 1, 2, 3)
    assert not vision.rule_holds
    image = _image(1280, 800)
    calls = processor.calls
    assert vision.grid(image) == _processed(processor, image) == (1, 28, 46)
    assert processor.calls == calls + 2  # the grid above, and the comparison


def test_the_grid_rule_processes_no_pixels_and_refuses_what_the_processor_refuses() -> None:
    class Counting(_processor_class()):  # type: ignore[misc]
        calls = 0

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            type(self).calls += 1
            return super().__call__(*args, **kwargs)

    vision = VisionProcessor(Counting(), 1, 2, 3)
    assert vision.rule_holds
    probes = Counting.calls
    for n in range(5):
        vision.grid(_image(1280, 800, n))
    assert Counting.calls == probes
    with pytest.raises(InvalidRequest, match="cannot take this image"):
        vision.grid(_image(20, 4100))  # past the aspect ratio of 200

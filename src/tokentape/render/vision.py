"""A vision-language model's image side: its image processor (from transformers) and its placeholder
tokens. The processor decides how many placeholder tokens an image takes (Qwen2-VL: one
`<|image_pad|>` per 2x2 block of 14-pixel patches after its own resize); the renderer's template puts
one placeholder per image, and `expand` makes it the processor's run, once.

transformers' PIL/numpy image processor is used, never its torchvision one: the same numbers on any
machine, and no torchvision needed.
"""

from __future__ import annotations

import functools
import io
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokentape.core.images import DecodedImage, ImageRun, expand_placeholders
from tokentape.errors import InvalidRequest
from tokentape.render.tokenizer import Tokenizer

__all__ = ["VisionProcessor", "load_vision", "QWEN2_VL_TOKENS"]

# (vision start, image placeholder, vision end) as Qwen2-VL, Qwen2.5-VL and Qwen3-VL spell them
QWEN2_VL_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
GRIDS_KEPT = 4096  # processed images remembered by digest: one screenshot re-sent each turn is processed once
# sizes (width, height) on which the resize rule is checked against the processor before it is trusted:
# below its smallest, odd and non-square, past its aspect-ratio limit, and the screens agents send
RULE_PROBES = ((27, 27), (56, 56), (57, 91), (100, 30), (333, 77), (10, 4000), (800, 500), (1280, 800), (1920, 1080))


class VisionProcessor:
    """The processor of one model family and its placeholder token IDs."""

    def __init__(self, processor: Any, opener: int, pad: int, closer: int, *, extra_ids: Sequence[int] = ()) -> None:
        self.processor = processor
        self.opener, self.pad, self.closer = opener, pad, closer
        self.merge_size = int(getattr(processor, "merge_size", 1) or 1)
        # tokens the policy must never sample: fed back, they would stand for an image nobody sent
        self.vision_token_ids = frozenset({opener, pad, closer, *extra_ids})
        self._grids: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def config(self) -> dict[str, Any]:
        """What a trainer's processor must be set to for the exported grids to hold."""
        size = getattr(self.processor, "size", None)
        return {
            "image_processor": type(self.processor).__name__,
            "patch_size": getattr(self.processor, "patch_size", None),
            "merge_size": self.merge_size,
            "temporal_patch_size": getattr(self.processor, "temporal_patch_size", None),
            "size": dict(size) if isinstance(size, Mapping) else size,
        }

    def outputs(self, images: Sequence[DecodedImage]) -> dict[str, Any]:
        """The processor's outputs for `images` (numpy): `pixel_values`, `image_grid_thw`, ..."""
        from PIL import Image

        opened = [Image.open(io.BytesIO(image.data)).convert("RGB") for image in images]
        result = self.processor(images=opened, return_tensors="np")
        return dict(result)

    def grid(self, image: DecodedImage) -> tuple[int, int, int]:
        """The processor's (t, h, w) patch grid for `image` (computed once per digest). Where the
        processor's resize rule was checked against the processor itself (`rule_holds`), the grid
        follows from the image's size alone: no pixels processed (40-100 ms and 24 MB of float32 for
        a 1280x800 screenshot)."""
        with self._lock:
            known = self._grids.get(image.digest)
            if known is not None:
                self._grids.move_to_end(image.digest)
                return known
        try:
            if self.rule_holds:
                t, h, w = self._ruled_grid(image.width, image.height)
            else:
                t, h, w = (int(v) for v in self.outputs([image])["image_grid_thw"][0])
        except Exception as exc:  # the processor's own refusal (e.g. an image too small for its patches)
            raise InvalidRequest(
                f"the model's image processor cannot take this image: {exc}", param="messages"
            ) from exc
        with self._lock:
            self._grids[image.digest] = (t, h, w)
            while len(self._grids) > GRIDS_KEPT:
                self._grids.popitem(last=False)
        return t, h, w

    def refusal(self, width: int, height: int) -> str | None:
        """Why the processor refuses an image of this size (its resize rule, e.g. Qwen2-VL's aspect
        ratio of at most 200), or None: asked when a request is parsed, so the 400 names the part."""
        try:
            self._ruled_grid(width, height)
        except ValueError as exc:
            return str(exc)
        return None

    def _ruled_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The grid Qwen2-VL's resize rule (`smart_resize`, the processor's own function) gives an
        image of this size under the processor's settings; ValueError where the rule refuses it."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        size = getattr(self.processor, "size", None)
        lowest = getattr(size, "shortest_edge", None) or 56 * 56
        highest = getattr(size, "longest_edge", None) or 14 * 14 * 4 * 1280
        patch = int(getattr(self.processor, "patch_size", 14) or 14)
        resized_height, resized_width = smart_resize(
            height, width, factor=patch * self.merge_size, min_pixels=lowest, max_pixels=highest
        )
        return 1, resized_height // patch, resized_width // patch

    @functools.cached_property
    def rule_holds(self) -> bool:
        """Whether the resize rule gives the processor's own grid (or its refusal) on every size of
        RULE_PROBES, blank images processed once: true for Qwen2-VL's processors and their settings;
        another processor, or one whose rule differs, has every image processed."""
        from PIL import Image

        for width, height in RULE_PROBES:
            try:
                grid = self.processor(images=[Image.new("RGB", (width, height))], return_tensors="np")
                processed: tuple[int, ...] | None = tuple(int(v) for v in grid["image_grid_thw"][0])
            except Exception:  # refused by the processor
                processed = None
            try:
                ruled: tuple[int, ...] | None = self._ruled_grid(width, height)
            except ValueError:
                ruled = None
            except Exception:
                return False
            if ruled != processed:
                return False
        return True

    def placeholders(self, grid: tuple[int, int, int]) -> int:
        """How many placeholder tokens the processor puts for an image of `grid`."""
        t, h, w = grid
        return t * h * w // (self.merge_size**2)

    def expand(
        self, tokens: Sequence[int], digests: Sequence[str], images: Mapping[str, DecodedImage], offset: int
    ) -> tuple[list[int], tuple[ImageRun, ...]]:
        """`tokens` (a rendering with one placeholder per image, for the images `digests` in order)
        with each placeholder expanded, and the runs at path positions (`offset`: where `tokens`
        start on the path)."""
        grids = [self.grid(images[digest]) for digest in digests]
        try:
            expanded, spans = expand_placeholders(
                tokens, self.pad, self.opener, self.closer, [self.placeholders(g) for g in grids]
            )
        except ValueError as exc:
            raise InvalidRequest(f"the images cannot be placed in this prompt: {exc}", param="messages") from exc
        runs = tuple(
            ImageRun(digest, offset + start, length, grid)
            for digest, grid, (start, length) in zip(digests, grids, spans, strict=True)
        )
        return expanded, runs


def _token_id(tokenizer: Tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None


def load_vision(directory: Path | None, tokenizer: Tokenizer, template_source: str = "") -> VisionProcessor | None:
    """The vision side of a model directory, or None for a text-only model. A model with Qwen2-VL's
    vision tokens gets transformers' PIL Qwen2-VL image processor, set from the directory's
    `preprocessor_config.json` when it has one (else that processor's defaults, Qwen2-VL's own).

    The tokens alone do not make a vision model: Qwen2.5's and Qwen3's text models share the
    vocabulary. A vision model's directory has an image processor's config, or its chat template
    writes the image placeholder."""
    opener, pad, closer = (_token_id(tokenizer, name) for name in QWEN2_VL_TOKENS)
    if opener is None or pad is None or closer is None:
        return None
    config = directory / "preprocessor_config.json" if directory is not None else None
    has_config = config is not None and config.is_file()
    if not has_config and QWEN2_VL_TOKENS[1] not in template_source:
        return None
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings: dict[str, Any] = {}
    if config is not None and has_config:
        saved = json.loads(config.read_text())
        known = (
            "min_pixels",
            "max_pixels",
            "patch_size",
            "merge_size",
            "temporal_patch_size",
            "image_mean",
            "image_std",
        )
        settings = {key: saved[key] for key in (*known, "size") if key in saved}
    extra = [t for name in ("<|video_pad|>",) if (t := _token_id(tokenizer, name)) is not None]
    return VisionProcessor(Qwen2VLImageProcessorPil(**settings), opener, pad, closer, extra_ids=extra)

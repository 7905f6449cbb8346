"""The image side of the fake vLLM server (`fake_engines.vllm_app`), as vLLM's token route plays it for
Qwen2-VL: its render route processes one image with transformers' Qwen2-VL image processor and
answers the placeholder run and features; its generate route takes token IDs with `features` and
refuses any that do not fit them (an unknown image, a placeholder range that does not hold exactly
the image's pads, a pad outside every range). An image named by its hash alone (null `kwargs_data`)
is taken when an earlier request brought its tensors, and is otherwise vLLM 0.32's answer to an
item its processor cache does not hold: a bare 500, an error event when streamed. A test
instrument: no model looks at the pixels.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from typing import Any

from PIL import Image

from tests.support.fake_engines import MISSING, FakeState

IM_START, IM_END, USER, NEWLINE = 151644, 151645, 872, 198
VISION_START, VISION_END, IMAGE_PAD = 151652, 151653, 151655


class FakeVision:
    def __init__(self, tensor_bytes: int = 0, *, record: bool = True, grid_by_size: bool = False) -> None:
        """`tensor_bytes`: the size each render's `kwargs_data` is padded to (a real 1280x800
        screenshot's are about 8 MB); `record`: keep the generate bodies that carried images;
        `grid_by_size`: process one image of each size only (a benchmark's screenshots share one)."""
        # imported here: the processor's module takes about a second, and the modules that import
        # this one are collected by every test worker
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.processor = Qwen2VLImageProcessorPil()
        self.tensor_bytes, self.record, self.grid_by_size = tensor_bytes, record, grid_by_size
        self._size_grids: dict[tuple[int, int], list[int]] = {}
        self.kwargs: dict[str, str] = {}  # mm hash -> the digest of the serialised outputs it answered
        self.grids: dict[str, list[int]] = {}  # mm hash -> the image's patch grid
        self.renders = 0
        self.generations: list[dict[str, Any]] = []  # generate bodies that carried images
        # vLLM's processor cache: the hashes whose tensors a generate request brought, which later
        # requests may name with null `kwargs_data`; an unknown one is vLLM's bare 500
        self.held: set[str] = set()
        self.misses = 0

    def attach(self, state: FakeState) -> FakeState:
        state.render, state.check_features, state.end_of_turn = self.render, self.check, IM_END
        return state

    def render(self, body: dict[str, Any]) -> dict[str, Any]:
        (part,) = body["messages"][0]["content"]
        data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
        image = Image.open(io.BytesIO(data)).convert("RGB")
        thw = self._size_grids.get(image.size) if self.grid_by_size else None
        if thw is None:
            grid = self.processor(images=[image], return_tensors="np")
            thw = self._size_grids[image.size] = [int(v) for v in grid["image_grid_thw"][0]]
        pads = thw[0] * thw[1] * thw[2] // 4
        mm_hash = hashlib.sha256(data).hexdigest()[:32]
        tensors = base64.b64encode(json.dumps({"grid": thw}).encode()).decode()
        tensors += "A" * max(0, self.tensor_bytes - len(tensors))
        self.kwargs[mm_hash], self.grids[mm_hash] = _digest(tensors), thw
        self.renders += 1
        tokens = [IM_START, USER, NEWLINE, VISION_START, *[IMAGE_PAD] * pads, VISION_END, IM_END, NEWLINE]
        features = {
            "mm_hashes": {"image": [mm_hash]},
            "mm_placeholders": {"image": [{"offset": 4, "length": pads}]},
            "kwargs_data": {"image": [tensors]},
        }
        return {"request_id": "render-fake", "token_ids": tokens, "features": features, "sampling_params": {}}

    def check(self, body: dict[str, Any]) -> str | None:
        tokens: list[int] = body["token_ids"]
        features = body.get("features") or {}
        hashes = (features.get("mm_hashes") or {}).get("image") or []
        places = (features.get("mm_placeholders") or {}).get("image") or []
        kwargs = (features.get("kwargs_data") or {}).get("image") or []
        if not len(hashes) == len(places) == len(kwargs):
            return "features: hashes, placeholders and kwargs_data differ in length"
        covered: set[int] = set()
        if any(data is None and mm_hash not in self.held for mm_hash, data in zip(hashes, kwargs, strict=True)):
            self.misses += 1
            return MISSING
        for mm_hash, place, data in zip(hashes, places, kwargs, strict=True):
            if data is not None and self.kwargs.get(mm_hash) != _digest(data):
                return f"features: image {mm_hash} was not rendered by this server"
            start, length = place["offset"], place["length"]
            thw = self.grids[mm_hash]
            if length != thw[0] * thw[1] * thw[2] // 4:
                return f"features: image {mm_hash} takes {thw} patches, not {length} placeholders"
            if tokens[start : start + length] != [IMAGE_PAD] * length:
                return f"features: the range at {start} does not hold the image's pads"
            if tokens[start - 1] != VISION_START or tokens[start + length] != VISION_END:
                return f"features: the pads at {start} are not framed by the vision tokens"
            covered.update(range(start, start + length))
        stray = [i for i, t in enumerate(tokens) if t == IMAGE_PAD and i not in covered]
        if stray:
            return f"{len(stray)} image pad token(s) stand for no image (first at {stray[0]})"
        if hashes and self.record:
            self.generations.append(body)
        self.held.update(mm_hash for mm_hash, data in zip(hashes, kwargs, strict=True) if data is not None)
        return None


def _digest(tensors: str) -> str:
    return hashlib.sha256(tensors.encode()).hexdigest()

"""Images on vLLM's token route. `/inference/v1/generate` takes the prompt's token IDs with
`features`: per image its hash, its placeholder range in those IDs, and its processed tensors
(`kwargs_data`, vLLM's own serialisation). Only vLLM makes those tensors, through its render route
`/v1/chat/completions/render`: each image is rendered once, alone in a user message, and what vLLM
answers is kept by digest (a screenshot shown on every turn is rendered once).

The render answer is also the check against double expansion: the placeholder run vLLM's processor
makes for the image must be, token for token, the run the tape holds; otherwise the engine would
see another prompt than the one recorded, and the generation is refused before it starts.

Only new images carry their tensors. vLLM keeps the tensors of the items it was sent, by hash, in
its processor cache (`--mm-processor-cache-gb`, 4 GiB by default), and takes an item whose
`kwargs_data` is null from there. `SentImages` mirrors what that cache should hold (the hashes sent
in the last `SENT_MAX_BYTES` of tensors, well under vLLM's default), so a screenshot shown on every
turn travels once, not once a turn. vLLM answers an item it no longer holds (evicted, restarted,
another server behind the same URL) with a bare 500 that says nothing more; so a generation that
named an image by hash and failed before its first token is sent once more with every image's
tensors (`VLLMGenerateEngine.generate`), and the mirror starts again from nothing.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.bounded import BoundedCache
from tokentape.engines.base import PromptImage
from tokentape.engines.remote.wire import listed, quote
from tokentape.errors import EngineProtocolError

__all__ = [
    "RENDER_ROUTE",
    "RenderedImage",
    "SentImages",
    "features",
    "render_body",
    "render_cache",
    "rendered_image",
]

RENDER_ROUTE = "/v1/chat/completions/render"
RENDERS_MAX_BYTES = 256 * 1024 * 1024
SENT_MAX_BYTES = 1024**3  # of serialised tensors: a quarter of vLLM's default processor cache, in its units
SENT_MAX_ITEMS = 65_536  # hashes kept, whatever the size of their tensors (about 10 MB of them)


@dataclass(frozen=True, slots=True)
class RenderedImage:
    """What vLLM's render route made of one image: its hash, its run (markers included) and its
    serialised processor outputs."""

    mm_hash: str
    run: tuple[int, ...]
    kwargs_data: str | None

    def without_tensors(self) -> RenderedImage:
        """What is kept once vLLM holds the tensors: the hash and the run, a few bytes."""
        return RenderedImage(self.mm_hash, self.run, None)


def render_body(model: str, image: PromptImage) -> dict[str, Any]:
    """The render request for one image alone in a user message."""
    data = base64.b64encode(image.image.data).decode()
    url = f"data:{image.image.media_type};base64,{data}"
    return {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
    }


def rendered_image(answer: object) -> RenderedImage:
    """The one image of a render answer (a GenerateRequest: `token_ids` and `features`)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("features"), dict):
        raise EngineProtocolError(f"vLLM's render route answered without features: {quote(answer)}")
    tokens, found = listed(answer.get("token_ids"), "token_ids"), answer["features"]
    hashes = listed((found.get("mm_hashes") or {}).get("image"), "mm_hashes.image")
    places = listed((found.get("mm_placeholders") or {}).get("image"), "mm_placeholders.image")
    kwargs = listed((found.get("kwargs_data") or {}).get("image"), "kwargs_data.image") or [None]
    if len(hashes) != 1 or len(places) != 1 or not isinstance(places[0], dict):
        raise EngineProtocolError(f"vLLM's render of one image gave {len(hashes)} image features: {quote(found)}")
    offset, length = places[0].get("offset"), places[0].get("length")
    if not (isinstance(offset, int) and isinstance(length, int) and offset >= 1 and offset + length < len(tokens)):
        raise EngineProtocolError(f"vLLM's render gave a placeholder range outside its tokens: {quote(places[0])}")
    # the placeholder range covers the pads; the run on the tape holds the markers around them too
    return RenderedImage(str(hashes[0]), tuple(tokens[offset - 1 : offset + length + 1]), kwargs[0])


def render_cache(max_bytes: int = RENDERS_MAX_BYTES) -> BoundedCache[str, RenderedImage]:
    """Render answers by image digest, bounded by the bytes of their serialised tensors (a 1280x800
    screenshot's are megabytes: 1,024 of them were gigabytes)."""
    return BoundedCache(max_bytes, _render_size)


def _render_size(render: RenderedImage) -> int:
    return len(render.kwargs_data or "") + 8 * len(render.run) + len(render.mm_hash) + 200


class SentImages:
    """The hashes whose tensors vLLM was sent lately, as far as its processor cache should still hold
    them: least recently used first out, bounded by the tensors' bytes (the hashes alone are kept)."""

    def __init__(self, max_bytes: int = SENT_MAX_BYTES) -> None:
        self._sent: BoundedCache[str, int] = BoundedCache(max_bytes, lambda size: size, max_items=SENT_MAX_ITEMS)

    def __contains__(self, mm_hash: object) -> bool:
        return isinstance(mm_hash, str) and self._sent.get(mm_hash) is not None

    def took(self, renders: Sequence[RenderedImage]) -> None:
        """vLLM took a request with these images: the ones sent with tensors are held now."""
        for render in renders:
            if render.kwargs_data is not None:
                self._sent.put(render.mm_hash, len(render.kwargs_data))
            else:
                self._sent.get(render.mm_hash)  # used again: the least recently used go first

    def forget(self) -> None:
        self._sent.clear()


def features(prompt: Sequence[int], images: Sequence[PromptImage], renders: Sequence[RenderedImage]) -> dict[str, Any]:
    """The `features` of a generate request: each image's vLLM hash, its pads' range in `prompt`, its
    tensors (null for an image named by hash alone: its render carries none). Refuses
    (EngineProtocolError) when vLLM's run for an image is not the tape's."""
    hashes, places, kwargs = [], [], []
    for image, render in zip(images, renders, strict=True):
        run = image.run
        held = tuple(prompt[run.start : run.end])
        if held != render.run:
            raise EngineProtocolError(
                f"vLLM's processor expands image {run.digest[:12]} to {len(render.run) - 2} placeholder tokens "
                f"where the tape holds {run.length - 2} (or other tokens around them): it would see another "
                "prompt than the one recorded"
            )
        hashes.append(render.mm_hash)
        places.append({"offset": run.start + 1, "length": run.length - 2})
        kwargs.append(render.kwargs_data)
    return {"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": places}, "kwargs_data": {"image": kwargs}}

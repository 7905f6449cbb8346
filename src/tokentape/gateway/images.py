"""The image side of planning a request: each new image's placeholder expanded once by the model's
processor, the runs a path already holds, and the checks that keep a run from being fed back wrong.
Only requests whose messages hold images come here."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Container, Mapping, Sequence

from tokentape.core.images import DecodedImage, ImageRun, has_images, image_digests, masked_images
from tokentape.core.messages import Message, hash_chain
from tokentape.core.tape import TurnNode
from tokentape.errors import Conflict, InvalidRequest
from tokentape.render.vision import VisionProcessor

__all__ = ["Expansion", "first_image_message", "shape_chains", "stray_placeholder"]


def shape_chains(messages: Sequence[Message]) -> list[bytes]:
    """The chain hash of every prefix of `messages` with their images anonymous."""
    return list(hash_chain([masked_images(m) for m in messages]))


def first_image_message(messages: Sequence[Message], covered: int) -> int:
    """The first of the first `covered` messages that holds an image (where an image can have changed)."""
    return next((i for i, m in enumerate(messages[:covered]) if has_images([m])), 0)


Reader = Callable[[Sequence[str]], Awaitable[Mapping[str, DecodedImage]]]


class Expansion:
    """Expands the placeholders of rendered segments with one processor and the request's images;
    an image the request names without sending it (a continued conversation's) is read back by
    `read` if the session holds it (`held`: the digests its turns show)."""

    def __init__(
        self,
        vision: VisionProcessor,
        images: Mapping[str, DecodedImage],
        read: Reader | None = None,
        held: Container[str] = (),
    ) -> None:
        self.vision = vision
        self.images = images
        self._read = read
        self._held = held

    async def __call__(
        self, tokens: Sequence[int], messages: Sequence[Message], offset: int
    ) -> tuple[list[int], tuple[ImageRun, ...]]:
        """`tokens` (the rendering of `messages`, or of what follows a reply up to them) with each of
        their images' placeholders expanded; runs at path positions from `offset`."""
        digests = image_digests(messages)
        if not digests:
            return list(tokens), ()
        known = self.images
        missing = [d for d in digests if d not in known]
        if missing and self._read is not None:
            held = [d for d in dict.fromkeys(missing) if d in self._held]
            read = await self._read(held) if held else {}
            known = {**known, **read}
            missing = [d for d in missing if d not in known]
        if missing:
            raise InvalidRequest(
                f"the request refers to an image this session does not hold (sha256 {missing[0][:16]}...)",
                param="messages",
            )
        # the processor's resize and patching take milliseconds per screenshot: off the event loop
        return await asyncio.to_thread(self.vision.expand, tokens, digests, known, offset)

    def check_sampled(self, node: TurnNode) -> None:
        """A turn that sampled a vision token is not continued: fed back, the token would stand for an
        image nobody sent (engines are told to ban them; this is the backstop)."""
        banned = self.vision.vision_token_ids
        at = next((i for i, token in enumerate(node.sampled) if token in banned), None)
        if at is not None:
            raise Conflict(
                f"turn {node.id} sampled the image placeholder token {node.sampled[at]} at its token {at}; a "
                "prompt that holds it would stand for an image nobody sent, so this branch takes no further turns",
                param="messages",
                code="placeholder_sampled",
            )


def stray_placeholder(prompt: Sequence[int], vision_ids: frozenset[int], runs: Sequence[ImageRun]) -> int | None:
    """The first position of `prompt` holding a vision token outside every image run (a placeholder
    with no image behind it), or None."""
    if not vision_ids:
        return None
    inside = 0  # the runs by start, walked beside the prompt
    ordered = sorted(runs, key=lambda run: run.start)
    for position, token in enumerate(prompt):
        while inside < len(ordered) and ordered[inside].end <= position:
            inside += 1
        if token in vision_ids and not (inside < len(ordered) and ordered[inside].start <= position):
            return position
    return None

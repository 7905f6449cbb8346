"""Images on the tape: how an image part looks inside a message, where its placeholder run sits on a
path, and the one expansion of a rendered placeholder into the run the model's processor asks for.

Inside the gateway an image part is `{"type": "image", "image": <digest>}`: the digest (SHA-256 of
the bytes as sent) names the image, so message identity (the hash chain) tells a changed image from
the same one sent again. A session's tree keeps only each image's facts (`ImageFacts`: digest, type,
size in bytes and pixels); the bytes live once in the store, whatever the number of sessions showing
the image, and are read back by digest when an engine or an export needs them
(`store.images.ImageLibrary`). A chat template
renders one placeholder per image part (Qwen2-VL: `<|vision_start|><|image_pad|><|vision_end|>`);
`expand_placeholders` turns each single pad into the processor's count, once, on the turn that
brings the image. Earlier turns' runs are recorded tokens and are never expanded again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.messages import Message

__all__ = [
    "IMAGE_PART",
    "DecodedImage",
    "ImageFacts",
    "ImageRun",
    "expand_placeholders",
    "has_images",
    "image_digests",
    "masked_images",
    "runs_from_json",
    "runs_to_json",
]

IMAGE_PART = "image"


@dataclass(frozen=True, slots=True)
class ImageFacts:
    """What a session's tree keeps of an image: everything but its bytes (`size`: how many)."""

    digest: str  # SHA-256 of the bytes, hex
    media_type: str
    width: int
    height: int
    size: int


@dataclass(frozen=True, slots=True)
class DecodedImage:
    """An image a client sent, checked: its bytes as sent, what they are, and its size in pixels."""

    digest: str  # SHA-256 of `data`, hex
    data: bytes
    media_type: str  # image/png, image/jpeg, image/gif, image/webp
    width: int
    height: int

    @property
    def facts(self) -> ImageFacts:
        return ImageFacts(self.digest, self.media_type, self.width, self.height, len(self.data))


@dataclass(frozen=True, slots=True)
class ImageRun:
    """One image's placeholder run on a path: `length` tokens from path position `start` (the markers
    included), for the image `digest`, whose processor grid is `grid` = (t, h, w) patches."""

    digest: str
    start: int
    length: int
    grid: tuple[int, int, int]

    @property
    def end(self) -> int:
        return self.start + self.length

    def shifted(self, offset: int) -> ImageRun:
        return ImageRun(self.digest, self.start + offset, self.length, self.grid)

    def as_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "start": self.start, "length": self.length, "grid_thw": list(self.grid)}


def runs_to_json(runs: Sequence[ImageRun]) -> list[list[Any]]:
    return [[run.digest, run.start, run.length, *run.grid] for run in runs]


def runs_from_json(saved: Iterable[Sequence[Any]] | None) -> tuple[ImageRun, ...]:
    return tuple(ImageRun(str(d), int(s), int(n), (int(t), int(h), int(w))) for d, s, n, t, h, w in saved or ())


def _is_image(part: object) -> bool:
    return isinstance(part, Mapping) and part.get("type") == IMAGE_PART


def _image_parts(message: Message) -> Iterable[Mapping[str, Any]]:
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            if _is_image(part):
                yield part


def image_digests(messages: Iterable[Message]) -> list[str]:
    """The digests of the image parts of `messages`, in the order a template renders them."""
    return [str(part.get(IMAGE_PART)) for message in messages for part in _image_parts(message)]


def has_images(messages: Iterable[Message]) -> bool:
    # a plain loop: this runs over the whole history twice a call, and most contents are strings
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(_is_image(part) for part in content):
            return True
    return False


def masked_images(message: Message) -> Message:
    """`message` with its images anonymous: the same conversation whatever pixels it shows. Two
    requests equal under this and different without it differ in an image only."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [{"type": IMAGE_PART} if isinstance(p, Mapping) and p.get("type") == IMAGE_PART else p for p in content]
    return {**message, "content": parts}


def expand_placeholders(
    tokens: Sequence[int], pad: int, opener: int, closer: int, lengths: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """`tokens` with the k-th single `pad` (between `opener` and `closer`) repeated `lengths[k]` times,
    and each image's run as (start, length) in the result, markers included.

    A pad outside that frame, or a count of pads other than the count of images, is a template that
    does not render images the way its processor expects: ValueError."""
    out: list[int] = []
    runs: list[tuple[int, int]] = []
    k = 0
    for i, token in enumerate(tokens):
        if token != pad:
            out.append(token)
            continue
        if k >= len(lengths):
            raise ValueError(f"the rendered prompt holds more image placeholders than the {len(lengths)} image(s) sent")
        if not (i > 0 and tokens[i - 1] == opener and i + 1 < len(tokens) and tokens[i + 1] == closer):
            raise ValueError("an image placeholder is not framed by the vision start and end tokens")
        runs.append((len(out) - 1, lengths[k] + 2))
        out.extend([pad] * lengths[k])
        k += 1
    if k != len(lengths):
        raise ValueError(f"the rendered prompt holds {k} image placeholder(s) for {len(lengths)} image(s)")
    return out, runs
